"""A sweep of `dynatrain selfcheck --chaos SEED` over many seeds: every drawn sequence of switches (world changes and,
with --inject, one process death included) must train as the run without switches.

    python bench/chaos.py --seeds 0-9 [--inject] [--model debug] --json bench/results/chaos/debug_0-9.json

Prints one line per seed (the sequence, whether it held, the largest loss difference, wall seconds) and writes them
all to the JSON; a failing seed is replayed with `dynatrain selfcheck --chaos SEED` (and the same options).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def seeds_of(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def run_seed(seed: int, args) -> dict:
    cmd = [sys.executable, "-m", "dynatrain.cli", "selfcheck", "--chaos", str(seed), "--model", args.model,
           "--steps-between", "1", "--json", *(["--inject"] if args.inject else []),
           *(["--n-layers", str(args.n_layers)] if args.n_layers else [])]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          timeout=args.timeout)
    seconds = time.monotonic() - start
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        result = {}
    sequence = next((line.split("--switches ", 1)[1] for line in proc.stderr.splitlines()
                     if line.startswith("selfcheck --chaos")), None)
    return {
        "seed": seed, "ok": proc.returncode == 0 and bool(result.get("ok")), "switches": sequence,
        "death": (result.get("chaos") or {}).get("death"), "loss_max_rel_diff": result.get("loss_max_rel_diff"),
        "samples_equal": result.get("samples_equal"), "seconds": round(seconds, 1),
        "error": None if proc.returncode == 0 else proc.stderr[-1500:],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0-9", help="seeds, e.g. 0-9 or 3,7,11-13")
    ap.add_argument("--model", default="debug")
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--inject", action="store_true", help="one process death in every sequence")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for seed in seeds_of(args.seeds):
        row = run_seed(seed, args)
        rows.append(row)
        print(f"seed {seed:>3}: {'ok  ' if row['ok'] else 'FAIL'} loss diff {row['loss_max_rel_diff']} "
              f"death at {row['death']} {row['seconds']:>6.1f}s  {row['switches']}", flush=True)
    summary = {"model": args.model, "n_layers": args.n_layers, "inject": args.inject, "seeds": len(rows),
               "passed": sum(r["ok"] for r in rows), "runs": rows}
    print(f"{summary['passed']} of {summary['seeds']} seeds held")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["passed"] == summary["seeds"] else 1


if __name__ == "__main__":
    sys.exit(main())
