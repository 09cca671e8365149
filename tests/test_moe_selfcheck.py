"""`dynatrain selfcheck --model moe-debug`: ep changes, a tp layout, a scale-in and a scale-out to HSDP with ep of the
zoo's MoE model, pipeline stages combined with ep and tp, and context parallelism with and without ep, each switch
bitwise equal to the DCP oracle and the next step too."""

import json
import subprocess
import sys

import pytest

from dynatrain.cli.selfcheck import zoo_config

# moe-debug's routing is skewed enough that in its second layer an ep rank's experts get no token at all from its
# third step on: that rank must still join both all-to-alls of the backward.
# The scale-out at the end admits two new processes into replicated expert shards.
SEQUENCE = "dp_shard=4,ep=4 > dp_shard=4,ep=2 > dp_shard=2,tp=2 > dp_shard=2,ep=2 > dp_replicate=2,dp_shard=2,ep=2"


def _selfcheck(sequence: str) -> dict:
    cmd = [sys.executable, "-m", "dynatrain.cli", "selfcheck", "--model", "moe-debug",
           "--switches", sequence, "--steps-between", "2", "--json", "--timeout", "260"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_moe_selfcheck_switches_ep_tp_and_world_bitwise():
    result = _selfcheck(SEQUENCE)
    assert result["ok"] and result["model"] == "moe-debug" and result["worlds"] == [4, 4, 4, 2, 4]
    # the global batch is kept by every layout: lcm of the data-parallel sizes 4, 4, 2, 2, 4 times the micro-batch of 2
    assert result["joiners"] == 2 and result["global_batch"] == 8
    switches = result["switches"]
    assert [(s["from"], s["to"], s["world_to"]) for s in switches] == [
        ("dp_shard=4,ep=4", "dp_shard=4,ep=2", 4), ("dp_shard=4,ep=2", "dp_shard=2,tp=2", 4),
        ("dp_shard=2,tp=2", "dp_shard=2,ep=2", 2), ("dp_shard=2,ep=2", "dp_replicate=2,dp_shard=2,ep=2", 4)]
    assert all(s["bitwise_equal"] is True and s["step_after_equal"] is True for s in switches)
    # the whole new world loaded the oracle's checkpoint, the joiners of the scale-out included
    assert [s["compared_on"] for s in switches] == [4, 4, 2, 4]
    assert all(s["bytes_moved"] > 0 for s in switches)
    assert result["loss_max_rel_diff"] <= 1e-5 and len(result["losses"]) == 10


# Pipeline stages with experts: ep inside each stage, tp inside each stage, then a scale-in to pure FSDP on 3 and back.
# Each stage's routers carry their own auxiliary loss into the backward; losses equal the run that never switched.
PP_SEQUENCE = "dp_shard=4,ep=4 > pp=2,dp_shard=2,ep=2 > pp=2,tp=2 > dp_shard=3 > dp_shard=4,ep=4"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_moe_selfcheck_through_pipeline_stages_with_ep_and_tp_bitwise():
    result = _selfcheck(PP_SEQUENCE)
    assert result["ok"] and result["worlds"] == [4, 4, 4, 3, 4]
    switches = result["switches"]
    assert [(s["from"], s["to"]) for s in switches] == [
        ("dp_shard=4,ep=4", "pp=2,dp_shard=2,ep=2"), ("pp=2,dp_shard=2,ep=2", "pp=2,tp=2"),
        ("pp=2,tp=2", "dp_shard=3"), ("dp_shard=3", "dp_shard=4,ep=4")]
    assert all(s["bitwise_equal"] is True and s["step_after_equal"] is True for s in switches)
    assert [s["compared_on"] for s in switches] == [4, 4, 3, 4]
    assert all(s["bytes_moved"] > 0 for s in switches)
    # Without each stage's auxiliary loss in the backward the losses drift apart by about 1e-3 within these steps.
    assert result["loss_max_rel_diff"] <= 1e-5 and len(result["losses"]) == 10


def test_selfcheck_knows_the_moe_zoo_and_refuses_an_ep_that_does_not_divide_the_experts():
    from dynatrain.cli import main

    assert zoo_config("moe-debug").n_experts == 8 and zoo_config("debug").name == "debug"
    with pytest.raises(SystemExit) as err:
        main(["selfcheck", "--model", "moe-debug", "--switches", "dp_shard=3,ep=3 > dp_shard=3"])
    assert "ep=3 does not divide n_experts=8" in str(err.value)
    with pytest.raises(SystemExit) as err:
        main(["selfcheck", "--model", "no-such-model"])
    assert "moe-debug" in str(err.value) and "debug" in str(err.value)


# Context parallelism for the MoE model: into cp with ep (the ep group takes whole cp groups from dp_shard x cp), then
# cp with tp (experts FSDP-sharded over dp_shard x cp), and back. The routers' auxiliary loss is taken over whole
# sequences: the cp ranks sum their token shares.
CP_SEQUENCE = "dp_shard=4,ep=4 > dp_shard=2,cp=2,ep=2 > cp=2,tp=2 > dp_shard=4,ep=4"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_moe_selfcheck_through_cp_with_and_without_ep_bitwise():
    result = _selfcheck(CP_SEQUENCE)
    assert result["ok"] and result["worlds"] == [4, 4, 4, 4] and result["samples_equal"]
    switches = result["switches"]
    assert [(s["from"], s["to"]) for s in switches] == [
        ("dp_shard=4,ep=4", "dp_shard=2,cp=2,ep=2"), ("dp_shard=2,cp=2,ep=2", "cp=2,tp=2"),
        ("cp=2,tp=2", "dp_shard=4,ep=4")]
    assert all(s["bitwise_equal"] is True and s["step_after_equal"] is True for s in switches)
    assert [s["compared_on"] for s in switches] == [4, 4, 4]
    assert all(s["bytes_moved"] > 0 for s in switches)
    assert result["loss_max_rel_diff"] <= 1e-5 and len(result["losses"]) == 8
