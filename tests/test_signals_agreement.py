"""Agreeing on one request across ranks: the slot every rank sends, and the merge every rank computes alike."""

from __future__ import annotations

import itertools

import pytest

from dynatrain.signals.agreement import SLOT_BYTES, Proposal, Slot, decode_slot, encode_slot, merge_proposals
from dynatrain.signals.request import ScaleRequest


def _proposal(rank, wall, devices=None, layout=None, leave=(), source="control", deadline_in=None, wait=False):
    return Proposal(rank, devices, layout, tuple(leave), source, f"from rank {rank}", wall, deadline_in, wait)


# ------------------------------------------------------------------------------------------------ agreement
def test_slot_round_trip_and_size_limit():
    p = _proposal(3, 1234.5, layout="dp_shard=2,tp=2", leave=(3,), source="preemption", deadline_in=12.0)
    tensor = encode_slot(Slot(p, listening=True))
    assert tensor.numel() == SLOT_BYTES and str(tensor.dtype) == "torch.uint8"
    assert decode_slot(tensor) == Slot(p, True)
    waiting = _proposal(0, 1.0, devices=4, wait=True)
    assert decode_slot(encode_slot(Slot(waiting))).proposal.wait is True
    assert decode_slot(encode_slot(Slot())) == Slot(None, False)
    with pytest.raises(ValueError, match="does not fit the 64-byte agreement slot"):
        encode_slot(Slot(p), size=64)


def test_proposal_carries_wall_time_and_remaining_grace():
    request = ScaleRequest(leave=(1,), source="preemption", received_at=100.0, deadline=130.0, reason="x" * 2000)
    p = Proposal.from_request(1, request, now_wall=5000.0, now_mono=110.0)
    assert p.wall_time == pytest.approx(4990.0) and p.deadline_in == pytest.approx(20.0)
    assert len(p.reason) == 512  # reasons grow when requests coalesce; the slot stays small


def test_merge_unites_leaving_ranks_and_the_latest_target_wins_in_any_order():
    proposals = [
        _proposal(0, 10.0, devices=3, source="control"),
        _proposal(1, 12.0, leave=(1,), source="preemption", deadline_in=25.0),
        _proposal(2, 11.0, layout="tp=2", source="file", leave=(2,)),
        None,
    ]
    merged = {merge_proposals(list(order)) for order in itertools.permutations(proposals)}
    assert len(merged) == 1
    (m,) = merged
    assert (m.devices, m.layout, m.leave, m.source, m.origin_rank) == (None, "tp=2", (1, 2), "file", 2)
    assert m.sources == ("control", "preemption", "file") and m.deadline_in == 25.0


def test_merge_ties_go_to_the_lowest_rank_and_a_bare_preemption_has_no_target():
    same = [_proposal(r, 7.0, layout="tp=2" if r else "dp_shard=2", source="trace") for r in (1, 0)]
    assert merge_proposals(same).layout == "dp_shard=2"
    bare = merge_proposals([None, _proposal(1, 3.0, leave=(1,), source="preemption")])
    assert (bare.devices, bare.layout, bare.leave, bare.source) == (None, None, (1,), "preemption")
    assert merge_proposals([None, None]) is None


def test_the_winning_target_brings_its_wait():
    request = ScaleRequest(devices=4, source="trace", wait=True)
    assert Proposal.from_request(0, request).wait is True
    waiting, later = _proposal(0, 5.0, devices=4, wait=True), _proposal(1, 6.0, devices=3)
    assert merge_proposals([waiting, later]).wait is False  # the later target wins, without waiting
    merged = merge_proposals([waiting, _proposal(1, 6.0, leave=(1,), source="preemption")])
    assert (merged.devices, merged.leave, merged.wait) == (4, (1,), True)
    assert merged.describe() == "devices=4 leave=1 wait"
    assert merge_proposals([_proposal(1, 3.0, leave=(1,), source="preemption")]).wait is False
