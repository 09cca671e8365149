"""`dynatrain selfcheck --model debug` through context-parallel layouts: into cp from FSDP, a larger cp, cp with tp,
cp with pipeline stages, and a scale-in out of cp; every switch bitwise equal to the DCP oracle, the step after it
too, and the losses those of the run without switches."""

import json
import subprocess
import sys

import pytest

SEQUENCE = "dp_shard=4 > dp_shard=2,cp=2 > cp=4 > cp=2,tp=2 > pp=2,cp=2 > dp_shard=3"


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_selfcheck_switches_into_out_of_and_between_cp_layouts_bitwise():
    cmd = [sys.executable, "-m", "dynatrain.cli", "selfcheck", "--model", "debug", "--switches", SEQUENCE,
           "--steps-between", "2", "--json", "--timeout", "380"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=410)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["worlds"] == [4, 4, 4, 4, 4, 3] and result["samples_equal"]
    switches = result["switches"]
    assert [(s["from"], s["to"]) for s in switches] == [
        ("dp_shard=4", "dp_shard=2,cp=2"), ("dp_shard=2,cp=2", "cp=4"), ("cp=4", "cp=2,tp=2"),
        ("cp=2,tp=2", "pp=2,cp=2"), ("pp=2,cp=2", "dp_shard=3")]
    assert all(s["bitwise_equal"] is True and s["step_after_equal"] is True for s in switches)
    assert [s["compared_on"] for s in switches] == [4, 4, 4, 4, 3]
    # FSDP shards over dp_shard x cp: the states of dp_shard=4, dp_shard=2,cp=2 and cp=4 lie alike, nothing moves
    assert [s["bytes_moved"] == 0 for s in switches] == [True, True, False, False, False]
    assert result["loss_max_rel_diff"] <= 1e-5 and len(result["losses"]) == 12


def test_selfcheck_refuses_a_cp_that_does_not_split_the_sequence_into_2cp_chunks():
    from dynatrain.cli import main

    with pytest.raises(SystemExit) as err:
        main(["selfcheck", "--model", "debug", "--seq-len", "36", "--switches", "dp_shard=4 > cp=4"])
    assert "cp=4 splits each sequence into 2*cp = 8 equal chunks" in str(err.value)
