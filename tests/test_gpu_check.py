"""The one-GPU check (bench/gpu_check.sh) stays runnable where no GPU is: the script parses, and every part's CPU
fallback (the same code on CPU tensors and gloo, tiny sizes) runs to a passing JSON of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], check=True)


@pytest.mark.multiprocess
def test_every_part_runs_its_cpu_fallback_to_a_json_of_its_own(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check" / "run.py"), "--out", str(tmp_path),
                           "--device", "cpu"], env=env, capture_output=True, text=True, timeout=240)
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 0, (summary["statuses"], proc.stdout[-3000:], proc.stderr[-3000:])
    assert set(summary["statuses"]) == {"elastic_steps", "engine_switch", "hash_cost", "group_generations",
                                        "heap_settings", "moe_devices"}
    for part, status in summary["statuses"].items():
        own = json.loads((tmp_path / f"{part}.json").read_text())
        assert own["status"] == status and own["device"] == "cpu"
        assert status == ("skipped" if part == "heap_settings" else "ok"), (part, own)
    engine = summary["parts"]["engine_switch"]
    assert len(engine["switches"]) == 4 and all(row["checks"]["bitwise"] for row in engine["switches"])
    assert len(summary["parts"]["group_generations"]["generations"]) == 20


def test_a_part_that_crashes_leaves_the_others_json(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check" / "run.py"), "--out", str(tmp_path),
                           "--device", "cuda", "--parts", "hash_cost,heap_settings"], env=env, capture_output=True,
                          text=True, timeout=120)
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 1
    assert summary["statuses"] == {"hash_cost": "error", "heap_settings": "error"}  # no CUDA here: each says so
    assert "no CUDA device" in summary["parts"]["hash_cost"]["error"]
