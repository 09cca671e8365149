"""What the switch's check costs: its ``verify`` phase against the whole stall, per switch, slowest rank.

    python bench/verify_cost.py --model 125m --devices 4 --repeats 2 --json bench/results/verify/125m.json

Per switch, the best of ``--repeats`` runs (slowest rank each), with the check and the same switches without it.
The check hashes every element of every moved state twice (before and after, each indexed by the tensor's own
placements) and all-reduces one vector; the goal is at most 10% of the stall on `125m`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from dynatrain.launch.local import launch_local

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="125m")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--source", default="dp_shard=4")
    ap.add_argument("--chain", default="dp_shard=2,tp=2;dp_shard=4;tp=2,dp_shard=2;dp_shard=4")
    ap.add_argument("--repeats", type=int, default=1, help="runs with the check and without it, interleaved")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    runs = {"checked": [], "unchecked": []}
    for _ in range(args.repeats):
        for kind in runs:
            with tempfile.TemporaryDirectory() as tmp:
                extra = ["--no-verify"] if kind == "unchecked" else []
                ranks = launch_local([str(HERE / "_verify_worker.py"), "--model", args.model, "--source", args.source,
                                      "--chain", args.chain, *extra], args.devices, Path(tmp),
                                     timeout=args.timeout, env={"OMP_NUM_THREADS": "1"}, name="verify")
            runs[kind].append(ranks)
    rows = []
    for i, rep in enumerate(runs["checked"][0][0]["reports"]):
        stall = min(max(r["reports"][i]["stall_s"] for r in ranks) for ranks in runs["checked"])
        verify = min(max(r["reports"][i]["phases"].get("verify", 0.0) for r in ranks) for ranks in runs["checked"])
        unchecked = min(max(r["reports"][i]["stall_s"] for r in ranks) for ranks in runs["unchecked"])
        rows.append({"switch": f"{rep['old_layout']} -> {rep['new_layout']}", "stall_s": stall, "verify_s": verify,
                     "verify_share": verify / stall, "stall_unchecked_s": unchecked,
                     "verified": all(r["reports"][i]["verified"] for ranks in runs["checked"] for r in ranks),
                     "bytes_total": rep["bytes_total"], "bytes_moved": rep["bytes_moved"]})
    share = max(r["verify_share"] for r in rows)
    result = {"command": "python bench/verify_cost.py " + " ".join(sys.argv[1:]), "model": args.model, "devices": args.devices, "switches": rows, "verify_share_max": share,
              "goal": "verify_share_max <= 0.10", "goal_met": share <= 0.10}
    for r in rows:
        print(f"{r['switch']:36s} stall {r['stall_s']:.2f}s  verify {r['verify_s']:.3f}s "
              f"({r['verify_share']:.1%}; unchecked stall {r['stall_unchecked_s']:.2f}s) verified={r['verified']}")
    print(f"largest share: {share:.1%} (goal <= 10%)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
