"""`bench/lost_time.py` runs its chain on `debug` cold, warm and online from a standby pool (``online`` differs only
in when its joiners start): every world forms, every process reports, and every figure is measured from marks the
trial really wrote (a warm restart whose later worlds cannot rendezvous hangs here instead of half an hour into a
recording)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_each_way_runs_the_whole_chain(tmp_path):
    out = tmp_path / "lost.json"
    # Forked ranks: the chains are what this checks, and a restart's start-up (most of its time) is not.
    cmd = [sys.executable, str(REPO / "bench/lost_time.py"), "--repeats", "1", "--steady", "2", "--timeout", "240",
           "--fork-ranks", "--ways", "cold,warm,online-pool", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["trials_done"] == 3
    assert sorted(t["way"] for t in data["trials"]) == ["cold", "online-pool", "warm"]
    for trial in data["trials"]:
        assert len(trial["figures"]) == 2, trial["way"]
        for fig in trial["figures"]:
            assert math.isfinite(fig["lost_s"]) and fig["median_step_s"] > 0 and fig["first_step_ratio"] > 0
            assert fig["m"] >= 5 and len(fig["steady_steps_s"]) == 2
        segments = sorted(len(r["segments"]) for r in trial["ranks"])
        # 4 -> 2 -> 4: cold runs every world in new processes; warm keeps ranks 0 and 1 through all three worlds;
        # online keeps one Trainer per process, the 2 that leave and the 2 that join included.
        assert segments == {"cold": [1] * 10, "warm": [1, 1, 1, 1, 3, 3], "online-pool": [1] * 6}[trial["way"]]
        if trial["way"].startswith("online"):
            # A survivor reports both switches, a leaver the one it left at, a joiner (rank -1) none.
            reports = lambda r: 1 if r["left"] else 2 if r["rank"] >= 0 else 0
            assert all(len(r["reports"]) == reports(r) for r in trial["ranks"])
            # The joiners' side of the scale-out, phase by phase, from the report of the switch each joined by.
            scale_in, scale_out = trial["figures"]
            assert scale_in["joiners"] == [] and len(scale_out["joiners"]) == 2
            for side in scale_out["joiners"]:
                assert {"admission", "lightning_setup", "lightning_optimizer", "loop_restore"} <= set(side["outside"])
                assert all(v >= 0 for v in side["outside"].values())
                assert "transfer" in side["phases"] and side["first_step_s"] > 0 and side["steady_faults"] >= 0
            assert "online-pool" in proc.stdout.split("The joiners' side")[1]
