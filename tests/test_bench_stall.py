"""The stall model's benches on small inputs: `bench/build_cost.py` times a dense and a mixture-of-experts build per
tensor, and `bench/stall_prediction.py` writes one `dynatrain plan` prediction per case and hash rate, with its
command."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path, *argv):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_build_cost_per_tensor(tmp_path):
    out = tmp_path / "build.json"
    _run(tmp_path, str(REPO / "bench/build_cost.py"), "--pairs", "debug:dp_shard=2,tp=2;moe-debug:dp_shard=2,ep=2",
         "--repeats", "1", "--json", str(out))
    rows = json.loads(out.read_text())["results"]
    assert [(r["model"], r["layout"]) for r in rows] == [("debug", "dp_shard=2,tp=2"), ("moe-debug", "dp_shard=2,ep=2")]
    for r in rows:
        assert r["parameters_and_buffers"] > 0 and r["total_cpu_s"] > 0 and "load_average_1min" in r
        assert r["per_tensor_s"]["total"] == pytest.approx(r["total_s"] / r["parameters_and_buffers"])


def test_stall_prediction_writes_every_case_and_rate(tmp_path):
    _run(tmp_path, str(REPO / "bench/stall_prediction.py"), "--out", str(tmp_path), "--cases", "llama3_70b_fsdp")
    files = sorted(p.name for p in tmp_path.glob("*.json"))
    assert files == ["llama3_70b_fsdp.cpu_hash.json", "llama3_70b_fsdp.gpu_hash_estimate.json"]
    cpu, gpu = (json.loads((tmp_path / f).read_text()) for f in files)
    assert cpu["command"].startswith("dynatrain plan --model llama3-70b") and "--hash-s-per-gib 0.14" in cpu["command"]
    assert gpu["plan"]["stall"]["check"] < cpu["plan"]["stall"]["check"]
    assert gpu["plan"]["stall"]["formation"] == cpu["plan"]["stall"]["formation"] > 0
