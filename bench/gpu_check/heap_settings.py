"""Part (e): dynatrain's glibc heap settings (`dynatrain.runtime.memory.HEAP_TUNABLES`, on by default in every process it
starts) on and off, measured where they never were: the training steps of part (a) in a fresh process each way
(glibc reads them at start-up), for step time, page faults per step and peak resident memory. Nothing is checked
against a threshold: the figures decide whether GPU hosts keep the settings.

    python bench/gpu_check/heap_settings.py --device cuda --out /tmp/e.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import common
import torch


def add_args(ap) -> None:
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds for each of the two runs")


def run(args, device: torch.device) -> dict:
    if device.type != "cuda":  # what the settings do on a CPU host is measured by bench/heap.py
        return {"status": "skipped", "reason": "skipped: no CUDA (the CPU's figures: bench/heap.py)"}
    from dynatrain.runtime.memory import heap_env
    from dynatrain.settings import HEAP_ENV

    runs, checks = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for heap in ("reuse", "glibc"):
            out = Path(tmp) / f"{heap}.json"
            env = heap_env({**os.environ, HEAP_ENV: heap})
            proc = subprocess.run([sys.executable, str(Path(__file__).with_name("elastic_steps.py")), "--device",
                                   str(device.type), "--out", str(out)], env=env, timeout=args.timeout,
                                  capture_output=True, text=True)
            got = json.loads(out.read_text()) if out.exists() else {"status": "error", "error": proc.stderr[-2000:]}
            keep = ("status", "error", "model", "median_step_s", "step_s_range", "minor_faults_per_step",
                    "max_rss_bytes", "max_memory_reserved")
            runs[heap] = {"glibc_tunables": env.get("GLIBC_TUNABLES"), **{k: got.get(k) for k in keep}}
            checks[f"{heap}_trained"] = got.get("status") == "ok"
    reuse, glibc = runs["reuse"], runs["glibc"]
    ratio = (reuse["median_step_s"] / glibc["median_step_s"]
             if reuse.get("median_step_s") and glibc.get("median_step_s") else None)
    return {"runs": runs, "step_time_reuse_over_glibc": ratio, "checks": checks}


if __name__ == "__main__":
    common.run_part("heap_settings", __doc__, run, add_args)
