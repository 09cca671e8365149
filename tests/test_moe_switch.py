"""The zoo's mixture-of-experts decoder is an ordinary user of the switch path: a LightningModule parallelises it
in configure_model() (data, tensor and expert parallelism) and it switches online, stacked experts, router and
balancing buffers included."""

from __future__ import annotations

import pytest
from _launch import launch

SEQUENCE = ["dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2", "tp=4", "dp_shard=4"]
EP_SEQUENCE = ["dp_shard=4,ep=2", "dp_shard=2,tp=2,ep=2", "dp_shard=4", "dp_replicate=2,dp_shard=2,ep=2",
               "dp_shard=4,ep=4"]


STEPS = len(EP_SEQUENCE) + 1  # both sequences run as many steps, so one run without switches serves both


@pytest.fixture(scope="module")
def without_switches(tmp_path_factory):
    [static, *_] = launch("user_switch.py", 4, ["--layout", "dp_shard=4", "--steps", str(STEPS), "--moe"],
                          tmp_path_factory.mktemp("static"))
    return static


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("start,sequence", [("dp_shard=4", SEQUENCE), ("dp_shard=4,ep=4", EP_SEQUENCE)],
                         ids=["dp-tp", "ep"])
def test_moe_debug_switches_through_every_layout_and_trains_as_without_switches(tmp_path, start, sequence,
                                                                                without_switches):
    static = without_switches
    switches = ";".join(f"{i + 1}:{layout}" for i, layout in enumerate(sequence))
    for res in launch("user_switch.py", 4, ["--layout", start, "--steps", str(STEPS), "--moe", "--switches", switches],
                      tmp_path / "switched"):
        assert [r["new_layout"] for r in res["reports"]] == sequence
        assert all(r["verified"] is True for r in res["reports"])  # every state bitwise where it was
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(res["losses"], static["losses"])), \
            (res["losses"], static["losses"])
        assert len(res["losses"]) == STEPS
        # the auxiliary-loss-free balancing state moved with the experts: the bias is the static run's
        assert res["expert_bias"] == static["expert_bias"] and any(any(b) for b in res["expert_bias"])


SGD = ["--steps", "4", "--moe", "--optimizer", "sgd"]


@pytest.fixture(scope="module")
def data_parallel_sgd(tmp_path_factory):
    [static, *_] = launch("user_switch.py", 4, ["--layout", "dp_shard=4", *SGD], tmp_path_factory.mktemp("dp"))
    return static


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
# experts FSDP-sharded over efsdp=2, and whole on each rank (efsdp=1) beside tensor parallelism
@pytest.mark.parametrize("layout", ["dp_shard=4,ep=2", "dp_shard=2,tp=2,ep=2"])
def test_expert_parallel_training_equals_data_parallel(tmp_path, layout, data_parallel_sgd):
    """Same global batch, same losses: ep only changes where an expert's tokens are computed. The tolerance is
    fp32 reordering: an expert's gradient sums its tokens in another order (grouped by source rank) and the
    reduction runs over efsdp instead of all of dp_shard. SGD with momentum, not Adam: Adam's update hides a
    gradient off by a constant factor, SGD's does not."""
    static = data_parallel_sgd
    for res in launch("user_switch.py", 4, ["--layout", layout, *SGD], tmp_path / "ep"):
        assert len(res["losses"]) == 4
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(res["losses"], static["losses"])), \
            (res["losses"], static["losses"])
        assert res["expert_bias"] == static["expert_bias"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("args,bad", [
    (["--moe", "--experts", "6"], [
        ("dp_shard=4,ep=4", ["ep=4 does not divide n_experts=6", "choose an ep that divides"]),
        ("dp_shard=4,ep=3", ["ep=3 takes its ranks from dp_shard", "choose dp_shard a multiple of 3"]),
    ]),
    ([], [("dp_shard=4,ep=2", ["asks for ep=2", "splits no state over the ep mesh dimension", "use ep=1"])]),
], ids=["moe", "dense"])
def test_an_expert_layout_that_cannot_be_built_is_refused_at_request_time(tmp_path, args, bad):
    requests = ";".join(f"{step}:{layout}" for step, (layout, _) in enumerate(bad, start=1))
    results = launch("user_switch.py", 4, ["--layout", "dp_shard=4", "--steps", "3", *args, "--bad", requests],
                     tmp_path)
    for res in results:
        assert res["reports"] == [] and res["layout"] == "dp_shard=4" and len(res["losses"]) == 3
        assert len(res["errors"]) == len(bad)
        for error, (_, expected) in zip(res["errors"], bad):
            assert all(text in error for text in expected), error
        assert res["untouched"] == [True] * len(bad)  # every weight, buffer and optimizer tensor bitwise as before
