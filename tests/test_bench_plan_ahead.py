"""`bench/plan_ahead.py` on `debug`: both ways run, the requests planned ahead switch one step later from their
background plan, the others at their boundary, and the runs train alike (up to rounding)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_both_ways_switch_where_they_should_and_train_alike(tmp_path):
    out = tmp_path / "ahead.json"
    cmd = [sys.executable, str(REPO / "bench/plan_ahead.py"), "--model", "debug", "--seq-len", "64", "--every", "3",
           "--repeats", "1", "--timeout", "240", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    trials = {t["way"]: t for t in data["trials"]}
    assert sorted(trials) == ["ahead", "now"]
    for way, late in (("now", 0), ("ahead", 1)):
        switches = trials[way]["switches"]
        assert [s["change"] for s in switches] == ["dp_shard=2 -> tp=2", "tp=2 -> dp_shard=2"]
        assert [(s["requested_at"], s["switched_at"]) for s in switches] == [(3, 3 + late), (6, 6 + late)]
        assert all(s["prepared"] is bool(late) and s["stall_s"] > s["plan_s"] > 0 < s["request_s"] for s in switches)
        assert ("layout_median_step_s" in switches[0]) is bool(late)
    # One step runs under another layout, which sums in another order: equal up to rounding.
    now, ahead = trials["now"]["losses"], trials["ahead"]["losses"]
    assert len(now) == len(ahead) == 9 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ahead, now)), (ahead, now)
    assert [r["change"] for r in data["summary"]] == ["dp_shard=2 -> tp=2", "tp=2 -> dp_shard=2"]
