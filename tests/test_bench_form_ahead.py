"""`bench/form_ahead.py` on 2 processes: both ways run, every change's boundary is timed, and the summary compares
them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_form_ahead_times_both_ways(tmp_path):
    out = tmp_path / "form.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "bench/form_ahead.py"), "--processes", "2", "--repeats", "1",
                           "--allreduces", "3", "--json", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["way"] for r in result["rows"]] == ["in the stall", "ahead"]
    assert all(r["boundary_s"] > 0 for r in result["rows"])
    assert result["rows"][1]["formed_within_step"] in (True, False)
    summary = result["summary"]
    assert summary["ratio_ahead_over_stall"] == pytest.approx(
        summary["ahead"]["boundary_s_median"] / summary["in the stall"]["boundary_s_median"])
    assert result["command"].startswith("python bench/form_ahead.py --processes 2")
