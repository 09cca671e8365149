"""A rank that reports what its interpreter looks like (for tests/test_forked_ranks.py), then does what it is told."""

import argparse
import json
import os
import signal
import sys
import time

def zygote_parent() -> int:
    """The parent of this rank's parent: the process that forks the zygote of each launch, or the launcher itself."""
    with open(f"/proc/{os.getppid()}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--hang", default=None, help="write this rank's pid to HANG.<rank>, then sleep")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    if args.hang:
        __import__("pathlib").Path(f"{args.hang}.{rank}").write_text(str(os.getpid()))
        time.sleep(120)
    if rank == args.kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == args.fail_rank:
        print(f"rank {rank} fails on purpose", flush=True)
        sys.exit(3)
    if args.fail_rank >= 0:
        time.sleep(60)  # the launcher must stop this rank once its peer failed
    main = sys.modules["__main__"]
    Path = __import__("pathlib").Path
    Path(args.out).write_text(json.dumps({
        "rank": rank, "world": os.environ["WORLD_SIZE"], "argv0": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
        "main_file": os.path.basename(main.__file__), "path0": sys.path[0], "probe_env": os.environ.get("PROBE"),
        "preloaded": "xml.dom.minidom" in sys.modules, "zygote_parent": zygote_parent(),
    }))
