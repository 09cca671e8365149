"""`dynatrain selfcheck` with world changes: ranks leave, new processes join, every switch equals the DCP oracle."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SEQUENCE = "dp_shard=3 > dp_shard=2 > dp_shard=2,tp=2"


def test_selfcheck_scales_in_and_out_against_the_dcp_oracle():
    # No --devices: the first layout's product (3) is the initial world; the scale-out to 4 needs 2 new processes.
    cmd = [sys.executable, "-m", "dynatrain.cli", "selfcheck", "--model", "debug", "--n-layers", "2",
           "--switches", SEQUENCE, "--steps-between", "2", "--json", "--timeout", "240"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 3 and result["joiners"] == 2
    # lcm of the data-parallel sizes 3, 2, 2 times the micro-batch of 2
    assert result["global_batch"] == 12
    switches = result["switches"]
    assert [(s["from"], s["to"], s["world_from"], s["world_to"]) for s in switches] == [
        ("dp_shard=3", "dp_shard=2", 3, 2), ("dp_shard=2", "dp_shard=2,tp=2", 2, 4)]
    assert all(s["bitwise_equal"] is True and s["step_after_equal"] is True for s in switches)
    # The whole new world loaded the oracle's checkpoint, the joiners of the scale-out included.
    assert [s["compared_on"] for s in switches] == [2, 4]
    assert all(s["bytes_moved"] > 0 and s["peak_bytes"] > 0 for s in switches)
    assert result["loss_max_rel_diff"] <= 1e-5
    assert len(result["losses"]) == len(result["static_losses"]) == 6


def test_selfcheck_inject_a_joiner_and_a_leaver_that_die():
    """joiner-dies: the joiner of a scale-out is SIGKILLed before it says it is ready; its heartbeat stops, the job
    drops it and the scale-out after the join timeout, and the state is the committed one bit for bit.
    leaver-dies: the leaver of a 2 -> 1 scale-in dies as the transfer starts; the survivor stops with a clear
    error, and the job restarts on 1 process from the snapshot of step 2, bitwise; one step (step 3) is lost."""
    cmd = [sys.executable, "-m", "dynatrain.cli", "selfcheck", "--inject", "joiner-dies,leaver-dies",
           "--n-layers", "2", "--json", "--timeout", "200"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    joiner, leaver = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = ("scenario", "recovered", "steps_lost", "state_equal_to_committed")
    assert {k: joiner[k] for k in keys} == {
        "scenario": "joiner-dies", "recovered": True, "steps_lost": 0, "state_equal_to_committed": True}
    assert joiner["layout_after"] == "dp_shard=2"
    assert {k: leaver[k] for k in keys} == {
        "scenario": "leaver-dies", "recovered": True, "steps_lost": 1, "state_equal_to_committed": True}
    assert leaver["layout_after"] == "dp_shard=1"


def test_selfcheck_inject_refuses_an_unknown_scenario():
    from dynatrain.cli import main

    with pytest.raises(SystemExit) as err:
        main(["selfcheck", "--inject", "disk-dies"])
    text = str(err.value)
    assert "unknown scenario(s) ['disk-dies']" in text and "rank-dies" in text and "joiner-dies" in text, text
