"""`bench/meta_build.py` on `debug`: every layout that fits is built and its placements read for every parameter and
buffer; one that does not fit the model is skipped with the reason; the profile lists the parallelisation first."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from dynatrain.models.configs import get_model_config
from dynatrain.models.llama import Transformer

REPO = Path(__file__).resolve().parents[1]


def test_meta_build_times_every_layout_that_fits(tmp_path):
    out = tmp_path / "meta.json"
    cmd = [sys.executable, str(REPO / "bench/meta_build.py"), "--models", "debug", "--layouts",
           "dp_shard=4;dp_shard=2,tp=2;tp=8", "--repeats", "2", "--profile", "debug:dp_shard=2,tp=2",
           "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["results"]
    assert [r["layout"] for r in rows] == ["dp_shard=4", "dp_shard=2,tp=2", "tp=8"]
    built, skipped = rows[:2], rows[2]
    with torch.device("meta"):
        model = Transformer(get_model_config("debug"))
    states = len(list(model.named_parameters())) + len(list(model.named_buffers()))
    for r in built:
        assert r["parameters_and_buffers"] == states, r
        assert all(r[f"{p}_s"] > 0 for p in ("copy", "parallelize", "placements")), r
        assert r["total_s_range"][0] <= r["total_s"] <= r["total_s_range"][1]
    assert "tp=8 does not divide" in skipped["skipped"]
    top = data["profile"]["top"]
    dense = next(r for r in top if "parallelize_dense" in r["function"])
    assert dense["cumulative_s"] == top[0]["cumulative_s"] > 0
    assert [r["cumulative_s"] for r in top] == sorted((r["cumulative_s"] for r in top), reverse=True)
