"""The zoo's mixture-of-experts decoder is an ordinary user of the switch path: a LightningModule parallelises it
in configure_model() (data, tensor and expert parallelism) and it switches online, stacked experts, router and
balancing buffers included."""

from __future__ import annotations

import pytest
from _launch import launch, selfcheck_module

SEQUENCE = ["dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2", "tp=4", "dp_shard=4"]
EP_SEQUENCE = ["dp_shard=4,ep=2", "dp_shard=2,tp=2,ep=2", "dp_shard=4", "dp_replicate=2,dp_shard=2,ep=2",
               "dp_shard=4,ep=4"]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("start,sequence", [("dp_shard=4", SEQUENCE), ("dp_shard=4,ep=4", EP_SEQUENCE)],
                         ids=["dp-tp", "ep"])
def test_moe_debug_switches_through_every_layout_and_trains_as_without_switches(tmp_path, start, sequence):
    steps = len(sequence) + 1
    common = ["--steps", str(steps), "--moe"]
    [static, *_] = launch("user_switch.py", 4, ["--layout", "dp_shard=4", *common], tmp_path / "static")
    switches = ";".join(f"{i + 1}:{layout}" for i, layout in enumerate(sequence))
    for res in launch("user_switch.py", 4, ["--layout", start, *common, "--switches", switches],
                      tmp_path / "switched"):
        assert [r["new_layout"] for r in res["reports"]] == sequence
        assert all(r["verified"] is True for r in res["reports"])  # every state bitwise where it was
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(res["losses"], static["losses"])), \
            (res["losses"], static["losses"])
        assert len(res["losses"]) == steps
        # the auxiliary-loss-free balancing state moved with the experts: the bias is the static run's
        assert res["expert_bias"] == static["expert_bias"] and any(any(b) for b in res["expert_bias"])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["dp_shard=4,ep=2", "dp_shard=4,ep=4", "dp_shard=2,tp=2,ep=2"])
def test_expert_parallel_training_equals_data_parallel(tmp_path, layout):
    """Same global batch, same losses: ep only changes where an expert's tokens are computed. The tolerance is
    fp32 reordering: an expert's gradient sums its tokens in another order (grouped by source rank) and the
    reduction runs over efsdp instead of all of dp_shard. SGD with momentum, not Adam: Adam's update hides a
    gradient off by a constant factor, SGD's does not."""
    common = ["--steps", "4", "--moe", "--optimizer", "sgd"]
    [static, *_] = launch("user_switch.py", 4, ["--layout", "dp_shard=4", *common], tmp_path / "dp")
    for res in launch("user_switch.py", 4, ["--layout", layout, *common], tmp_path / "ep"):
        assert len(res["losses"]) == 4
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(res["losses"], static["losses"])), \
            (res["losses"], static["losses"])
        assert res["expert_bias"] == static["expert_bias"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("args,bad,expected", [
    (["--moe", "--experts", "6"], "dp_shard=4,ep=4", ["ep=4 does not divide n_experts=6", "choose an ep that divides"]),
    (["--moe"], "dp_shard=4,ep=3", ["ep=3 takes its ranks from dp_shard", "choose dp_shard a multiple of 3"]),
    ([], "dp_shard=4,ep=2", ["asks for ep=2", "splits no state over the ep mesh dimension", "use ep=1"]),
], ids=["ep-not-dividing-experts", "ep-not-dividing-dp_shard", "ep-on-a-dense-model"])
def test_an_expert_layout_that_cannot_be_built_is_refused_at_request_time(tmp_path, args, bad, expected):
    results = launch("user_switch.py", 4, ["--layout", "dp_shard=4", "--steps", "3", *args, "--bad", f"1:{bad}"],
                     tmp_path)
    for res in results:
        assert res["reports"] == [] and res["layout"] == "dp_shard=4" and len(res["losses"]) == 3
        [error] = res["errors"]
        assert all(text in error for text in expected), error
        assert res["untouched"] == [True]  # every weight, buffer and optimizer tensor bitwise as before


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_expert_layouts_through_world_changes_equal_the_dcp_oracle():
    """ep=4 on 4 processes -> 3 processes without ep (one leaves) -> 4 with tp and ep (a new process joins) -> HSDP
    with ep: each switch bit for bit as DCP would reshard, the step after it too."""
    layouts = ["dp_shard=4,ep=4", "dp_shard=3", "dp_shard=2,tp=2,ep=2", "dp_replicate=2,dp_shard=2,ep=2"]
    result = selfcheck_module("user_model:MoELM", layouts)
    assert result["worlds"] == [4, 3, 4, 4] and result["joiners"] == 1
