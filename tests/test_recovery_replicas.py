"""Survivors compare the copies they would recover from (`check.replicas`): equal replicas pass, a copy that
ran one more update than its twin is named, whoever compares."""

import pytest
import torch

from dynatrain.check.replicas import ReplicaSums, box_order, compare, explain, kept_scalars, local_sums
from dynatrain.switch.states import Kept
from dynatrain.vps.layout import Layout, StateSpec
from dynatrain.vps.parallel_config import ParallelConfig

STATES = (StateSpec("w", (8, 6)), StateSpec("w.exp_avg", (8, 6)), StateSpec("norm", (5,), tp_dim=None))


def _layout(cfg: str) -> Layout:
    return Layout.from_config(STATES, ParallelConfig.parse(cfg))


def _sources(layout: Layout, process: int, full: dict) -> dict:
    """What ``process`` holds of each full tensor, laid out as the layout says."""
    out = {}
    for spec in layout.states:
        held = layout.shards(spec.name, process)
        local = torch.empty(held.local_shape, dtype=torch.float32)
        for box, origin in zip(held.boxes, held.offsets):
            lo, hi = origin, tuple(o + h - l for o, l, h in zip(origin, box.lo, box.hi))
            local[tuple(slice(a, b) for a, b in zip(lo, hi))] = full[spec.name][
                tuple(slice(a, b) for a, b in zip(box.lo, box.hi))]
        out[spec.name] = local
    return out


def _kept(step: float = 3.0) -> Kept:
    return Kept(param_of={}, scalars={"w": {"step": torch.tensor(step)}}, order={},
                groups=[{"lr": 1e-3, "betas": (0.9, 0.95)}], schedulers=[{"last_epoch": 3}])


@pytest.fixture
def full():
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g) for s in STATES}


def _reports(layout, full, survivors, change=None, step=None):
    out = {}
    for p in survivors:
        sources = _sources(layout, p, full)
        if change is not None and p == change[0]:
            sources[change[1]].view(-1)[0] += 1e-3  # the update the others never ran
        kept = _kept(step if step is not None and p == survivors[-1] else 3.0)
        out[p] = ReplicaSums.from_json(local_sums(layout, p, sources, kept_scalars(kept)).to_json())
    return out


def test_equal_replicas_pass_and_every_shared_region_is_compared(full):
    layout = _layout("dp_replicate=2,dp_shard=2")
    # process 3 was lost: shard 0 of each state lives on 0 and 2, shard 1 on process 1 alone
    result = compare(layout, _reports(layout, full, [0, 1, 2]))
    assert result.differing == {}
    # one box of each of the 3 states shared by processes 0 and 2, and the 3 scalars held by all three
    assert result.compared == 3 + 3
    assert len(box_order(layout, 0)) == 3


def test_a_copy_that_differs_from_its_replica_is_named_with_who_holds_what(full):
    layout = _layout("dp_replicate=2,dp_shard=2")
    result = compare(layout, _reports(layout, full, [0, 1, 2], change=(2, "w.exp_avg")))
    assert list(result.differing) == ["w.exp_avg"]
    assert "[0, 0]..[4, 6]" in result.differing["w.exp_avg"] and "[0] / [2]" in result.differing["w.exp_avg"]
    text = explain(result.differing, ["a", "b", "c", "d"])
    assert "1 state(s) differ" in text and "w.exp_avg" in text and "old ranks of ['a', 'b', 'c', 'd']" in text


def test_a_change_on_a_region_nobody_else_holds_cannot_be_seen_and_is_not_counted(full):
    layout = _layout("dp_replicate=2,dp_shard=2")
    result = compare(layout, _reports(layout, full, [0, 1, 2], change=(1, "w")))
    assert result.differing == {} and result.compared == 6


def test_an_optimizer_step_counted_on_one_survivor_only_is_named(full):
    layout = _layout("dp_shard=2,tp=2")
    result = compare(layout, _reports(layout, full, [0, 1, 2, 3], step=4.0))
    assert list(result.differing) == ["w.step"] and "[0, 1, 2] / [3]" in result.differing["w.step"]


def test_a_report_that_does_not_fit_the_layout_or_is_malformed_is_refused(full):
    layout = _layout("dp_replicate=2")
    reports = _reports(layout, full, [0, 1])
    reports[1].boxes.pop()
    assert "#layout" in compare(layout, reports).differing
    with pytest.raises(ValueError, match="malformed"):
        ReplicaSums.from_json({"boxes": [1]})
    sources = _sources(layout, 0, full)
    sources["w"] = sources["w"][:2]
    with pytest.raises(ValueError, match=r"state 'w'.*shape \(8, 6\), it holds \(2, 6\)"):
        local_sums(layout, 0, sources, {})


def test_many_differing_states_are_counted_beyond_those_shown():
    text = explain({f"s{i}": "differs" for i in range(11)})
    assert "11 state(s)" in text and "s7: differs" in text and "s8" not in text and "and 3 more" in text
