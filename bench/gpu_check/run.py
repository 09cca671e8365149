"""The one-GPU check: every part in its own process, in turn, each with its own time limit, so that a part that
crashes or hangs (a CUDA fault, an NCCL wait) still leaves the others' JSON. Writes ``<out>/<part>.json`` per part
and ``<out>/gpu_check.json`` with all of them; exits 1 when a part failed or raised. `bash bench/gpu_check.sh`
runs it with the device machine's own Python.

    python bench/gpu_check/run.py --out /tmp/gpu_check                 # CUDA where visible, else the CPU fallback
    python bench/gpu_check/run.py --out /tmp/gpu_check --parts moe_devices,hash_cost
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (part, seconds it may take on one GPU): the sum stays under 8 minutes.
PARTS = (("elastic_steps", 90), ("engine_switch", 150), ("hash_cost", 30), ("group_generations", 60),
         ("heap_settings", 120), ("moe_devices", 30))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--parts", default=",".join(p for p, _ in PARTS))
    ap.add_argument("--deadline", type=float, default=470.0, help="seconds for all parts together")
    args = ap.parse_args()
    chosen = args.parts.split(",")
    unknown = set(chosen) - {p for p, _ in PARTS}
    if unknown:
        sys.exit(f"--parts: unknown {sorted(unknown)}; the parts are {[p for p, _ in PARTS]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, summary = time.perf_counter(), {"parts": {}}
    for part, limit in PARTS:
        if part not in chosen:
            continue
        left = args.deadline - (time.perf_counter() - started)
        path = out / f"{part}.json"
        path.unlink(missing_ok=True)
        if left < 5:
            summary["parts"][part] = {"part": part, "status": "error", "error": "not run: the check's time was spent"}
            continue
        t = time.perf_counter()
        try:
            subprocess.run([sys.executable, str(HERE / f"{part}.py"), "--device", args.device, "--out", str(path)],
                           timeout=min(limit, left), check=False)
            result = json.loads(path.read_text()) if path.exists() else {
                "part": part, "status": "error", "error": "the part ended without writing its JSON (a crash)"}
        except subprocess.TimeoutExpired:
            result = {"part": part, "status": "error", "error": f"over its {min(limit, left):.0f} s"}
        result["wall_s"] = time.perf_counter() - t
        path.write_text(json.dumps(result, indent=1, default=str))
        summary["parts"][part] = result
    statuses = {p: r["status"] for p, r in summary["parts"].items()}
    summary.update(statuses=statuses, seconds=time.perf_counter() - started, command=" ".join(sys.argv))
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({"statuses": statuses, "seconds": round(summary["seconds"], 1), "out": str(out)}))
    return 0 if all(s in ("ok", "skipped") for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
