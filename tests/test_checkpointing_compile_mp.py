"""Activation checkpointing and torch.compile under strategy="dynatrain" on 2 processes: every policy and compile
train like the plain run, and a switch with both on is verified bitwise, builds its target with the same options, and
its next step's loss matches. All runs share one launch (one Trainer each) to pay the start-up once; compile uses
aot_eager (see test_compile.py for why not inductor here)."""

import json

import pytest
from _launch import assert_close, launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

BOTH = {"ac": "selective:op", "compile": "aot_eager"}
MOE = {"model": "moe-debug", "layout": "dp_shard=2,ep=2"}
RUNS = {
    "plain": {},
    "full": {"ac": "full"},
    "selective_op": {"ac": "selective:op"},
    "every_2nd": {"ac": "selective:2"},
    "compiled": {"compile": "aot_eager"},
    "both": BOTH,
    # Requested during step 1: the switch runs at its end, and step 2 trains on tp=2.
    "switched": {**BOTH, "switches": {"1": "tp=2"}},
    # Expert parallelism: the recomputation runs the all-to-alls again in the backward.
    "moe_plain": MOE,
    "moe_full": {**MOE, "ac": "full"},
    "moe_every_2nd_compiled": {**MOE, "ac": "selective:2", "compile": "aot_eager"},
}
# run: (the run it must equal, checkpointed blocks, compiled blocks)
EXPECTED = {
    "full": ("plain", ["0", "1"], []),
    "selective_op": ("plain", ["0", "1"], []),
    "every_2nd": ("plain", ["1"], []),
    "compiled": ("plain", [], ["0", "1"]),
    "both": ("plain", ["0", "1"], ["0", "1"]),
    "moe_full": ("moe_plain", ["0", "1"], []),
    "moe_every_2nd_compiled": ("moe_plain", ["1"], ["0", "1"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch("block_options.py", 2, ["--runs", json.dumps(RUNS), "--steps", "3"],
                  tmp_path_factory.mktemp("block_options"), timeout=540)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_policy_and_compile_train_like_the_plain_run(runs, name):
    reference, checkpointed, compiled = EXPECTED[name]
    for rank in runs:
        plain, run = rank[reference], rank[name]
        assert len(plain["losses"]) == 3 and plain["losses"][-1] != plain["losses"][0]
        assert_close(run["losses"], plain["losses"])
        assert run["names"] == plain["names"]  # no wrapper module in any parameter name
        assert run["checkpointed"] == checkpointed and run["compiled"] == compiled


def test_a_switch_with_both_on_is_verified_and_its_next_step_matches(runs):
    for rank in runs:
        switched, static = rank["switched"], rank["both"]
        assert switched["layout"] == "tp=2"
        (report,) = switched["reports"]
        assert report["verified"] is True and report["step"] == 2
        # The target's blocks were built with the same policy and compiled for tp=2 at the step after the switch.
        assert switched["checkpointed"] == ["0", "1"] and switched["compiled"] == ["0", "1"]
        assert report["compile_s"] > 0
        assert switched["names"] == static["names"]
        assert_close(switched["losses"], static["losses"])
