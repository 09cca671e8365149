from __future__ import annotations

import numpy as np
import pytest

from dynatrain.models.specs import layout_for_model
from dynatrain.planner import NetworkModel, plan_switch
from dynatrain.vps import ParallelConfig

LAT = 20e-6


def test_intra_node_runs_at_nvlink_speed():
    net = NetworkModel()  # 3200 Gbit/s = 400 GB/s per GPU inside a node
    assert net.round_seconds([(0, 1, 4_000_000_000)]) == pytest.approx(0.01 + LAT)
    # A GPU receiving from two peers at once is the bottleneck of the round.
    assert net.round_seconds([(0, 2, 4_000_000_000), (1, 2, 4_000_000_000)]) == pytest.approx(0.02 + LAT)


def test_inter_node_per_gpu_rail_and_node_limit():
    net = NetworkModel()  # 8 x 200 Gbit/s: 25 GB/s per GPU, 200 GB/s per node
    assert net.round_seconds([(0, 8, 2_500_000_000)]) == pytest.approx(0.1 + LAT)
    # Eight GPUs of node 0 to eight of node 1 in parallel: the rails add up.
    assert net.round_seconds([(g, 8 + g, 2_500_000_000) for g in range(8)]) == pytest.approx(0.1 + LAT)
    shared = NetworkModel(nics_per_node=1)  # one NIC for eight GPUs: the node link is the limit
    assert shared.round_seconds([(0, 8, 2_500_000_000), (1, 9, 2_500_000_000)]) == pytest.approx(0.2 + LAT)


def test_intra_and_inter_overlap_and_rounds_add_up():
    net = NetworkModel()
    both = [(0, 1, 4_000_000_000), (0, 8, 250_000_000)]
    assert net.round_seconds(both) == pytest.approx(0.01 + LAT)
    traffic = (((0, 1, 0, 4_000_000_000),), (), ((0, 8, 0, 2_500_000_000),))
    assert net.predict_seconds(traffic) == pytest.approx(0.11 + 2 * LAT)


def test_bad_network_is_refused():
    with pytest.raises(ValueError, match="link_gbps"):
        NetworkModel(link_gbps=0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        NetworkModel(gpus_per_node=0)


def test_70b_128_to_64_is_predicted_under_a_second():
    old = layout_for_model("llama3-70b", ParallelConfig(dp_shard=128))
    net = NetworkModel()
    for leave in ((), tuple(range(64, 128))):
        plan = plan_switch(old, "dp_shard=64", leave=leave, gpus_per_node=8)
        assert net.predict_seconds(plan.traffic) < 1.0


def _busiest_link_seconds(net: NetworkModel, plan) -> float:
    """The seconds of the whole switch's bytes as one round, without its latency: what its busiest link carries,
    the least any schedule can take."""
    src = np.concatenate([r.src for r in plan.traffic])
    dst = np.concatenate([r.dst for r in plan.traffic])
    return net._round_seconds(src, dst, np.concatenate([r.nbytes for r in plan.traffic])) - net.round_latency_s


@pytest.mark.parametrize("new,leave", [("dp_shard=7,tp=8", range(56, 64)), ("dp_shard=16,tp=4", ())])
def test_rounds_take_what_the_busiest_link_carries(new, leave):
    # 70B at 64 ranks, a 2 GiB budget: several phases of several rounds. Each round moves the same fraction of every
    # pair's bytes, so no rank sends in one round what it could have sent while receiving in another.
    old = layout_for_model("llama3-70b", ParallelConfig.parse("dp_shard=8,tp=8"))
    plan = plan_switch(old, new, leave=leave, budget_bytes=2 << 30, gpus_per_node=8)
    net = NetworkModel()
    assert plan.num_rounds > len(plan.groups) > 1
    bound = _busiest_link_seconds(net, plan)
    assert net.predict_seconds(plan.traffic) <= 1.01 * bound + plan.num_rounds * net.round_latency_s


def _per_link_seconds(net: NetworkModel, messages) -> float:
    """The model's round time, summed message by message in plain Python."""
    loads: dict[tuple, int] = {}
    g = net.gpus_per_node
    for s, d, n in messages:
        links = (("intra", "out", s), ("intra", "in", d)) if s // g == d // g else (
            ("gpu", "out", s), ("gpu", "in", d), ("node", "out", s // g), ("node", "in", d // g))
        for link in links:
            loads[link] = loads.get(link, 0) + n
    rate = {"intra": net.intra_bytes_per_s, "gpu": net.gpu_inter_bytes_per_s, "node": net.node_inter_bytes_per_s}
    return max((b / rate[link[0]] for link, b in loads.items()), default=0.0) + net.round_latency_s


@pytest.mark.parametrize("nics", [8, 1])
def test_plan_figures_match_message_by_message_sums(nics):
    # The per-process and per-link sums run on arrays indexed by process id; the same sums in plain Python over a
    # plan of several rounds, with traffic inside and between nodes, must give the same figures.
    old = layout_for_model("llama3-70b", ParallelConfig.parse("dp_shard=8,tp=8"))
    plan = plan_switch(old, "dp_shard=16,tp=4", budget_bytes=2 << 30, gpus_per_node=8)
    net = NetworkModel(nics_per_node=nics)
    assert plan.num_rounds > 1
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    peak = 0
    for rnd in plan.traffic:
        in_round: dict[int, int] = {}
        for s, d, _, n in rnd:
            sent[s] = sent.get(s, 0) + n
            received[d] = received.get(d, 0) + n
            in_round[s] = in_round.get(s, 0) + n
            in_round[d] = in_round.get(d, 0) + n
        peak = max(peak, *in_round.values(), 0)
        assert net.round_seconds([(s, d, n) for s, d, _, n in rnd]) == pytest.approx(
            _per_link_seconds(net, [(s, d, n) for s, d, _, n in rnd]), rel=1e-12)
    assert plan.rank_bytes() == (sent, received)
    assert plan.peak_staging_bytes == peak
    assert any(s // 8 == d // 8 for rnd in plan.traffic for s, d, _, _ in rnd)
    assert any(s // 8 != d // 8 for rnd in plan.traffic for s, d, _, _ in rnd)
