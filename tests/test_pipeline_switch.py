"""Online pp switches checked by `dynatrain selfcheck` against the DCP oracle: pp 1 -> 2 -> 4 -> 2 with tp -> 1 in
one world, and an elastic job going from pp=2,dp_shard=2 on 4 processes to pp=3 on 3 and back."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def selfcheck(switches: str, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "dynatrain.cli", "selfcheck", "--model", "debug", "--switches", switches,
           "--steps-between", "2", "--json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"], result
    for s in result["switches"]:
        assert s["bitwise_equal"] is True and s["step_after_equal"] is True, s
        assert s["bytes_moved"] > 0
    assert result["loss_max_rel_diff"] <= 1e-5
    return result


def test_pp_changes_in_one_world_equal_the_oracle():
    result = selfcheck("dp_shard=4 > pp=2,dp_shard=2 > pp=4 > pp=2,tp=2 > dp_shard=4")
    assert [s["to"] for s in result["switches"]] == ["pp=2,dp_shard=2", "pp=4", "pp=2,tp=2", "dp_shard=4"]
    assert result["worlds"] == [4] * 5


def test_interleaved_stages_switch_between_pp_degrees():
    # Two stages per rank: 4 stages on pp=2, then all four on one rank with dp (pp=1), then back.
    result = selfcheck("pp=2 > dp_shard=2 > pp=2", "--pipeline-schedule", "Interleaved1F1B", "--stages-per-rank", "2")
    assert [s["to"] for s in result["switches"]] == ["dp_shard=2", "pp=2"]


def test_an_elastic_pipeline_goes_to_three_stages_on_three_processes_and_back():
    result = selfcheck("pp=2,dp_shard=2 > pp=3 > pp=2,dp_shard=2", "--timeout", "240")
    assert result["worlds"] == [4, 3, 4] and result["joiners"] == 1
    assert [(s["world_from"], s["world_to"]) for s in result["switches"]] == [(4, 3), (3, 4)]
    assert [s["compared_on"] for s in result["switches"]] == [3, 4]
