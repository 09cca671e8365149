"""The `SwitchPlan` the engine runs, and `plan_switch`, which builds it: assignment, routing, phases, rounds.

Two levels, so that one rank can plan a 16,384-rank switch alone:

* global and cheap: the route table (`planner.route_table`) gives the bytes of every ordered pair, and the
  rounds (`planner.rounds`) schedule only those byte counts. Each pair's bytes form one *stream*; a round gives
  a pair one contiguous slice of it. Every rank computes the same rounds from the same integers.
* per rank (`planner.rank_plan`): `SwitchPlan.rank_plan(rank)` expands only that rank's pairs into pieces and
  cuts each stream at the slice boundaries the rounds chose. Both ends of a pair build the same stream, so they
  cut it identically without talking.

Why a round cannot deadlock, for any number of ranks: within a round every rank posts all of its sends and
all of its receives at once (non-blocking, e.g. one ``batch_isend_irecv``) and only then waits. Each message
of round k is posted by both of its ends in round k, and at most one message per ordered pair exists per
round, so each posted operation has exactly one partner, posted without waiting on anything. By induction
over rounds every wait completes; ranks with nothing to do in a round skip it without a collective, and
messages between the same two ranks are matched in posting order, which both sides share. No pairing
pattern (XOR or otherwise) is needed, so no pair can be missed when the rank count is not a power of two.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dynatrain.planner.assignment import Assignment, assign, candidates, identity_map, kept_bytes
from dynatrain.planner.groups import state_groups
from dynatrain.planner.pages import with_small_pages
from dynatrain.planner.pair_bytes import sum_by
from dynatrain.planner.rank_plan import Message, RankPlan, Round, expand_rank
from dynatrain.planner.route_table import RouteTable, route_table
from dynatrain.planner.rounds import (  # noqa: F401  (min_budget, schedule_pairs: part of this module's API)
    MAX_ROUNDS, Slice, Slices, min_budget, schedule_groups, schedule_pairs, staging_share,
)
from dynatrain.planner.routing import Transfer, overlaps, saved_matrix
from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig

__all__ = ["MAX_ROUNDS", "Message", "RankPlan", "Round", "Slice", "Slices", "SwitchPlan", "Transfer", "min_budget",
           "plan_switch", "schedule_groups", "schedule_pairs", "staging_share"]


@dataclass(frozen=True, eq=False)
class SwitchPlan:
    """A switch from ``old`` to ``new`` (whose rank map the assignment chose), in rounds.

    ``traffic[k]`` lists round k's messages as (src, dst, stream offset, bytes), enough for statistics and
    for the network model; `rank_plan` gives one process its pieces. Build with `plan_switch`.
    """

    old: Layout
    new: Layout
    assignment: Assignment
    budget_bytes: int
    traffic: tuple[Slices, ...]
    table: RouteTable = field(repr=False)
    bytes_moved_identity: int | None = None
    # Phases (see `planner.groups`): state indices per group and each group's rounds [start, end).
    groups: tuple[tuple[int, ...], ...] = ()
    group_rounds: tuple[tuple[int, int], ...] = ()
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def staging_budget_bytes(self) -> int:
        """The part of the budget a round's staging may use; the rest holds the group in flight."""
        return staging_share(self.budget_bytes)

    def group_of(self, state_index: int) -> int:
        index = self._cache.get("group_of")
        if index is None:
            index = self._cache["group_of"] = {si: g for g, members in enumerate(self.groups) for si in members}
        return index.get(state_index, 0)

    def group_span(self, state_index: int) -> tuple[int, int]:
        """The rounds [start, end) of the phase that moves a state (the whole switch without phases)."""
        if not self.group_rounds:
            return 0, self.num_rounds
        return self.group_rounds[self.group_of(state_index)]

    @property
    def num_rounds(self) -> int:
        """At least 1: local copies run in round 0 even when nothing goes on the wire."""
        return max(1, len(self.traffic))

    @property
    def rounds_traffic(self) -> tuple[tuple[Slice, ...], ...]:
        return self.traffic + ((),) * (self.num_rounds - len(self.traffic))

    @property
    def processes(self) -> tuple[int, ...]:
        """Every process that takes part: holders of the old layout (including leavers) and of the new."""
        return tuple(sorted(set(self.old.processes) | set(self.new.processes)))

    @property
    def bytes_total(self) -> int:
        """All state, each element counted once."""
        return self.new.total_bytes

    @property
    def bytes_moved(self) -> int:
        return sum(int(rnd.nbytes.sum()) for rnd in self.traffic)

    def rank_bytes(self) -> tuple[dict[int, int], dict[int, int]]:
        """(bytes sent, bytes received) per process over the whole switch: senders and receivers only."""
        senders, receivers, sent, recv, _ = self._loads()
        return (dict(zip(senders.tolist(), sent[senders].tolist())),
                dict(zip(receivers.tolist(), recv[receivers].tolist())))

    @property
    def peak_staging_bytes(self) -> int:
        """The most bytes one process sends plus receives in one round."""
        return self._loads()[4]

    def _loads(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """(the processes that send, those that receive, the bytes each process id sends and receives in all, the
        most one process sends plus receives in a round); one pass over the messages, millions at 16,384 ranks."""
        loads = self._cache.get("loads")
        if loads is None:
            rounds = [rnd for rnd in self.traffic if len(rnd)]
            top = 1 + max((int(max(rnd.src.max(), rnd.dst.max())) for rnd in rounds), default=-1)
            sending, receiving = np.zeros(top, dtype=bool), np.zeros(top, dtype=bool)
            sent, recv, peak = np.zeros(top, dtype=np.int64), np.zeros(top, dtype=np.int64), 0
            for rnd in rounds:
                sending[rnd.src] = receiving[rnd.dst] = True
                out, into = sum_by(rnd.src, rnd.nbytes, top), sum_by(rnd.dst, rnd.nbytes, top)
                sent += out
                recv += into
                peak = max(peak, int((out + into).max()))
            loads = self._cache["loads"] = np.flatnonzero(sending), np.flatnonzero(receiving), sent, recv, peak
        return loads

    # ----- per rank
    def rank_plan(self, rank: int) -> RankPlan:
        plan = self._cache.get(rank)
        if plan is None:
            plan = self._cache[rank] = expand_rank(self, rank)
        return plan

    def sends(self, rank: int, k: int) -> tuple[Message, ...]:
        return self.rank_plan(rank).sends[k]

    def recvs(self, rank: int, k: int) -> tuple[Message, ...]:
        return self.rank_plan(rank).recvs[k]

    def local_copies(self, rank: int, k: int | None = None) -> tuple[Transfer, ...]:
        """The rank's local copies, of round ``k`` or (None) of every round."""
        per_round = self.rank_plan(rank).local_copies
        return per_round[k] if k is not None else tuple(t for r in per_round for t in r)

    def release_round(self, rank: int) -> dict:
        return self.rank_plan(rank).release_round

    def alloc_round(self, rank: int) -> dict:
        return self.rank_plan(rank).alloc_round

    @property
    def rounds(self) -> tuple[Round, ...]:
        """Every round with every message and its pieces (expands every rank: for small worlds and tests)."""
        per_round: list[list[Message]] = [[] for _ in range(self.num_rounds)]
        for p in self.processes:
            for k, msgs in enumerate(self.rank_plan(p).sends):
                per_round[k] += msgs
        return tuple(Round(k, tuple(sorted(m, key=lambda x: (x.src, x.dst)))) for k, m in enumerate(per_round))

    def fingerprint(self, ranks: Iterable[int] | None = None) -> str:
        """A digest of the assignment, the rounds and the rank plans of ``ranks`` (default all): equal
        digests from two processes mean they would run the same switch."""
        h = hashlib.sha256()
        traffic = tuple(tuple(rnd) for rnd in self.traffic)
        h.update(repr((self.assignment, self.budget_bytes, traffic)).encode())
        for p in self.processes if ranks is None else ranks:
            rp = self.rank_plan(p)
            h.update(repr((rp.rank, rp.num_rounds, rp.sends, rp.recvs, rp.local_copies,
                           sorted(rp.release_round.items()), sorted(rp.alloc_round.items()))).encode())
        return h.hexdigest()


@with_small_pages
def plan_switch(
    old: Layout,
    new_config: ParallelConfig | str | Layout,
    *,
    leave: Iterable[int] = (),
    lost: Iterable[int] = (),
    joiners: Sequence[int] | None = None,
    rank_map: str | Sequence[int] = "optimal",
    budget_bytes: int = 2 << 30,
    gpus_per_node: int | None = None,
    compare_identity: bool = True,
) -> SwitchPlan:
    """Plan the switch of ``old``'s states to ``new_config``: assignment, routing, rounds.

    ``new_config`` is a layout shape, whose boxes follow from the states' rules, or a `Layout` of the same states
    whose boxes were read from the target's placements (its rank map is ignored: the assignment chooses one).

    ``leave``: processes that send what they hold, then get no position. ``lost``: processes already gone,
    whose data must come from replicas. ``joiners``: new processes (default: fresh ids as needed).
    ``rank_map``: "optimal", "identity" or an explicit process per new position. ``gpus_per_node``: keep
    every new TP group inside a node (process p lives on node p // gpus_per_node) and prefer replicas on
    the destination's node.
    """
    if isinstance(new_config, Layout):
        if new_config.config is None:
            raise ValueError("a target Layout needs its ParallelConfig (`config`) to plan against")
        old.same_states(new_config)
        new0 = new_config.with_rank_map(range(new_config.world_size))
        new_config = new_config.config
    else:
        new_config = ParallelConfig.parse(new_config)
        if new_config.pp > 1:
            # Which stage holds a layer depends on the model's stage split, which a layout shape does not carry.
            raise ValueError(
                f"a pipeline layout ({new_config.short()}) places whole layers on stages, which its shape alone does "
                "not say: pass the target as a Layout (e.g. models.specs.layout_for_model(model, layout))"
            )
        new0 = None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
    lost = sorted(set(int(p) for p in lost))
    cands, joins = candidates(old, new_config.world_size, leave, joiners, lost)
    src = old.without(lost) if lost else old
    if new0 is None:
        new0 = Layout.from_config(old.states, new_config)
    ovs = overlaps(src, new0)
    w = saved_matrix(ovs, src, new0, cands)
    asg = assign(w, cands, joins, new_config, rank_map, gpus_per_node)
    new = new0.with_rank_map(asg.rank_map)
    identity_moved = None
    if compare_identity:
        try:
            ident = identity_map(cands, new_config, gpus_per_node)
            identity_moved = new.needed_bytes - kept_bytes(w, cands, ident)
        except ValueError:
            identity_moved = None
    node_of = None if gpus_per_node is None else (lambda p: p // gpus_per_node)
    table = route_table(src, new, ovs, node_of)
    groups = state_groups(src, new, budget_bytes - staging_share(budget_bytes))
    traffic, group_rounds = schedule_groups(table, groups, budget_bytes)
    return SwitchPlan(src, new, asg, budget_bytes, traffic, table, identity_moved, groups, group_rounds)
