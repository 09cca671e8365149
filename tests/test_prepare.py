"""The next world prepared in the background: the same plan as at the boundary, used only when the inputs match."""

import json
from types import SimpleNamespace

import pytest

from dynatrain.engine.checks import expected_destinations
from dynatrain.models.configs import get_model_config
from dynatrain.switch.prepare import (
    INTENT_KEY,
    WARM_KEY,
    ChangeInputs,
    JoinerPrep,
    MemberPrep,
    plan_from_payload,
    plan_world_change,
    target_order,
)
from dynatrain.models.specs import model_states
from dynatrain.runtime.background import Background
from dynatrain.vps.parallel_config import ParallelConfig
from dynatrain.vps.rules import rule_sharding

MEMBERS = ["000000-000000", "000000-000001"]


class DictStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key, value) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key) -> bytes:
        return self.data[key]

    def check(self, keys) -> bool:
        return all(k in self.data for k in keys)


@pytest.fixture(scope="module")
def specs():
    return model_states(get_model_config("debug").with_overrides(n_layers=2), "fp32")


def inputs(specs, joiners, members=MEMBERS, target="dp_shard=4", leave=(), budget=64 << 20):
    old, new = ParallelConfig.parse("dp_shard=2"), ParallelConfig.parse(target)
    return ChangeInputs.build(specs, [rule_sharding(s.rule, old) for s in specs],
                              [rule_sharding(s.rule, new) for s in specs], old, [0, 1], members,
                              new, leave, joiners, "optimal", budget)


def test_target_order_follows_mesh_positions_unless_a_joiner_would_be_rank_zero():
    def plan(*rank_map):
        return SimpleNamespace(new=SimpleNamespace(rank_map=rank_map))

    # The optimal 2 -> 4 arrangement keeps half the state: ranks follow the positions, so groups ascend.
    assert target_order(plan(0, 2, 1, 3), {0, 1}) == ([0, 2, 1, 3], [0, 1, 2, 3])
    # A joiner at position 0 would take rank 0 from the members: ranks follow the sorted ids instead.
    assert target_order(plan(2, 0, 3, 1), {0, 1}) == ([0, 1, 2, 3], [2, 0, 3, 1])
    # Every member left: nobody to keep rank 0 for.
    assert target_order(plan(3, 2), {0, 1}) == ([3, 2], [0, 1])


def test_a_plan_prepared_before_the_joiners_are_known_is_the_plan_for_the_ones_admitted(specs):
    early = inputs(specs, None)
    late = inputs(specs, ["000003-4242", "000007-99"])
    assert early == late and early.union != late.union  # the plan's inputs match; the names are only known now
    prepared, direct = plan_world_change(early), plan_world_change(late)
    assert prepared.plan.new.rank_map == direct.plan.new.rank_map
    assert prepared.plan.bytes_moved == direct.plan.bytes_moved < prepared.plan.bytes_total
    assert (prepared.order, prepared.target_ranks) == (direct.order, direct.target_ranks)
    assert prepared.target_members(late.union)[0] == MEMBERS[0]  # rank 0 stays with a member
    assert set(prepared.target_members(late.union)) == set(MEMBERS) | {"000003-4242", "000007-99"}


def test_an_older_standby_admitted_after_a_newer_joiner_gets_a_plan_of_its_own(specs):
    # A member that joined as 000005-... and a standby registered before it (000002-...): the standby sorts
    # between the members, so the plan's ids differ from the ones prepared for joiners that sort last.
    members = ["000000-000000", "000005-000001"]
    assert inputs(specs, None, members) != inputs(specs, ["000002-777", "000006-888"], members)


def test_a_scale_in_and_out_prepared_together(specs):
    early = inputs(specs, None, target="dp_shard=2,tp=2", leave=(1,))
    late = inputs(specs, ["000004-1", "000004-2", "000009-3"], target="dp_shard=2,tp=2", leave=(1,))
    assert early == late and len(early.joiners) == 3
    wp = plan_world_change(early)
    assert 1 not in wp.plan.new.rank_map  # the leaver gets no position


def test_member_prep_plans_in_the_background(specs):
    prep = MemberPrep(inputs(specs, None))
    assert prep.plan().plan.new.rank_map == plan_world_change(inputs(specs, None)).plan.new.rank_map
    assert prep.done()


def test_a_joiner_plans_from_the_published_intent_and_uses_it_only_for_the_same_inputs(specs):
    store = DictStore()
    prep = MemberPrep(inputs(specs, None))
    joiner = JoinerPrep(store)
    joiner.poll(0.0)
    assert joiner.prepared is None  # nothing published yet
    prep.plan()
    prep.publish(store)
    assert prep.published and INTENT_KEY in store.data
    joiner.poll(0.05)
    assert joiner.prepared is None  # polls are spaced out
    joiner.poll(1.0)
    assert joiner.prepared is not None

    payload = {**json.loads(store.get(INTENT_KEY)), "union": ["x"], "checkpoint": {}, "scalars": {}}
    plan, old_layout = joiner.plan_for(payload)
    direct, _ = plan_from_payload(payload)
    assert plan.new.rank_map == direct.new.rank_map and plan.bytes_moved == direct.bytes_moved
    assert old_layout.config.short() == "dp_shard=2"
    assert joiner.plan_for({**payload, "budget": payload["budget"] // 2}) is None  # other inputs: plan again


def test_a_waiting_joiner_allocates_its_shards_once_planned_and_hands_them_over_only_if_they_fit(specs):
    store = DictStore()
    joiner = _planned_joiner(specs, store, "cpu")
    # Allocated on a thread of its own, by the poll that finds the intent planned (this one or the next).
    joiner.poll(2.0)
    joiner.settle()
    intent = json.loads(store.get(INTENT_KEY))
    plan, _ = plan_from_payload(intent)
    me = intent["joiners"][1]
    want = {n: tuple(sh) for n, (sh, _) in expected_destinations(plan, me).items()}
    assert want and {n: tuple(t.shape) for n, t in joiner.ahead.items()} == want
    held = joiner.ahead
    got = joiner.destinations_for(plan, me)
    assert got is held and all(got[n] is held[n] for n in want)
    assert joiner.destinations_for(plan, me) is None  # handed over once

    joiner = _planned_joiner(specs, DictStore(), "cpu")  # planned dp_shard=4, admitted to a three-process world
    joiner.poll(2.0)
    joiner.settle()
    assert joiner.ahead
    three = plan_world_change(inputs(specs, None, target="dp_shard=3")).plan
    assert joiner.destinations_for(three, 2) is None and joiner.ahead == {}

    idle = _planned_joiner(specs, DictStore(), None)  # without a device nothing is allocated
    idle.poll(2.0)
    assert idle.ahead is None


def test_a_joiner_prepares_before_it_says_it_is_ready_when_an_intent_is_published(specs):
    # Admission can follow the joiner's "ready" at once, before any poll while it waits.
    store = DictStore()
    early = JoinerPrep(store, "cpu")
    early.prepare_now()
    assert early.prepared is None and early.ahead is None  # nothing published: it prepares while it waits
    prep = MemberPrep(inputs(specs, None))
    prep.plan()
    prep.publish(store)
    joiner = JoinerPrep(store, "cpu")
    joiner.prepare_now()
    assert joiner.prepared.done() and joiner.ahead
    held = joiner.ahead
    joiner.poll(0.0)
    joiner.poll(5.0)
    assert joiner.ahead is held  # the same intent: planned and allocated once


def _planned_joiner(specs, store, device) -> JoinerPrep:
    """A joiner that has read and planned a published dp_shard=2 -> 4 intent."""
    prep = MemberPrep(inputs(specs, None))
    prep.plan()
    prep.publish(store)
    joiner = JoinerPrep(store, device)
    joiner.poll(1.0)
    joiner.prepared.result()
    return joiner


def test_rank_zero_publishes_the_intent_from_the_plans_thread_as_soon_as_it_is_planned(specs):
    store = DictStore()
    prep = MemberPrep(inputs(specs, None), connect=lambda: store)
    prep.plan()
    assert prep.published and json.loads(store.get(INTENT_KEY)) == {**prep.plan().intent(), WARM_KEY: 0}

    def unreachable():
        raise ConnectionError("no store")

    prep = MemberPrep(inputs(specs, None), connect=unreachable)
    assert prep.plan().plan is not None and not prep.published  # the plan stands; the boundary publishes
    other = DictStore()
    prep.publish(other)
    assert prep.published and INTENT_KEY in other.data


def test_a_failed_background_plan_is_not_published_and_raises_where_the_switch_uses_it(specs):
    store = DictStore()
    prep = MemberPrep(inputs(specs, None, budget=0))
    with pytest.raises(ValueError, match="budget_bytes must be a positive integer"):
        prep.plan()
    prep.publish(store)
    assert INTENT_KEY not in store.data

    job = Background("key", lambda: 1 // 0, "test")
    with pytest.raises(ZeroDivisionError):
        job.result()
    assert job.done()


def test_the_joiners_warm_their_allocator_with_the_members_working_memory(specs, monkeypatch):
    import dynatrain.switch.prepare as prepare

    warmed = []
    monkeypatch.setattr(prepare, "warm_allocator", lambda n, device: warmed.append((n, device)) or n)
    store = DictStore()
    prep = MemberPrep(inputs(specs, None), working_bytes=3 * 2**20)
    prep.plan()
    prep.publish(store)
    assert json.loads(store.get(INTENT_KEY))[prepare.WARM_KEY] == 3 * 2**20
    joiner = JoinerPrep(store, "cpu")
    joiner.prepare_now()
    assert warmed == [(3 * 2**20, "cpu")] and joiner.warmed == 3 * 2**20
    assert prepare.WARM_KEY not in joiner.prepared.key  # not a plan input: the switch's payload does not carry it
    joiner.poll(5.0)
    assert len(warmed) == 1  # once per intent
