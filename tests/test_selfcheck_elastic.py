"""`dynatrain selfcheck` with faults injected into world changes. Scale-ins and scale-outs against the DCP oracle are
held by tests/test_moe_selfcheck.py (`--model`) and tests/test_user_module.py (`--module`)."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


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
