"""Schedule: transfers -> rounds under a staging-memory budget, and the `SwitchPlan` the engine runs.

Two levels, so that one rank can plan a 1,024-rank switch alone:

* `schedule_pairs` (global, cheap): only the byte count of every ordered pair is scheduled. Each pair's
  bytes form one *stream* (its pieces in a fixed order); a round gives a pair one contiguous slice of its
  stream. Every rank computes the same rounds from the same integers.
* `SwitchPlan.rank_plan(rank)` (per rank): the rank expands only its own pairs into pieces and cuts each
  stream at the slice boundaries the rounds chose. Both ends of a pair build the same stream, so they cut
  it identically without talking.

Why a round cannot deadlock, for any number of ranks: within a round every rank posts all of its sends and
all of its receives at once (non-blocking, e.g. one ``batch_isend_irecv``) and only then waits. Each message
of round k is posted by both of its ends in round k, and at most one message per ordered pair exists per
round, so each posted operation has exactly one partner, posted without waiting on anything. By induction
over rounds every wait completes; ranks with nothing to do in a round skip it without a collective, and
messages between the same two ranks are matched in posting order, which both sides share. No pairing
pattern (XOR or otherwise) is needed, so no pair can be missed when the rank count is not a power of two.

Stream order: pieces sorted by itemsize (largest first), then state order, then destination shard and
box. Largest-first means every piece starts at a byte offset that is a multiple of its own itemsize (all
itemsizes are powers of two), so a cut snaps to an element boundary knowing only the bytes per itemsize,
and the receiver can view its buffer as the piece's dtype without a copy. State order within a stream
means every pair walks through the states in the same order, so a source shard is finished (and freed)
roughly when all pairs have passed its state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynatrain.planner.groups import state_groups
from dynatrain.planner.assignment import Assignment, assign, candidates, identity_map, kept_bytes
from dynatrain.planner.routing import RouteTable, Transfer, overlaps, route_table, saved_matrix
from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig

Slice = tuple[int, int, int, int]  # (src, dst, stream offset, bytes)
MAX_ROUNDS = 100_000  # beyond this a budget is a typo (bytes for MiB), not a plan anyone wants to run


def min_budget(pair_bytes: dict) -> int:
    """The smallest budget that works: one element of the widest dtype that moves (1 when nothing moves)."""
    return max((size for segs in pair_bytes.values() for size, b in segs if b), default=1)


def schedule_pairs(pair_bytes: dict, budget: int) -> tuple[tuple[Slice, ...], ...]:
    """Rounds of slices such that no rank's sent + received bytes in a round exceed ``budget``.

    Greedy per round: pairs are taken busiest-rank first (ties: the pair furthest behind in its stream, then
    ids, so one rank's streams progress together through the states), each gets as much of its stream as
    both ends still have room for, at most a fair share of the budget of its busier end, cut at an element
    boundary. The first pair of a round always advances
    by at least one element, so the loop ends. Integers only, so every rank gets the same rounds.
    """
    need = min_budget(pair_bytes)
    if budget < need:
        raise ValueError(
            f"a staging budget of {budget} bytes is smaller than the largest indivisible piece "
            f"(one element of {need} bytes): give a budget of at least {need} bytes"
        )
    pairs = [p for p in sorted(pair_bytes) if sum(b for _, b in pair_bytes[p])]
    ends = []  # per pair: [(segment end offset, itemsize)]
    for p in pairs:
        pos, segs = 0, []
        for size, b in pair_bytes[p]:
            if b % size:
                raise ValueError(f"pair {p}: {b} bytes of itemsize {size} is not a whole number of elements")
            if size & (size - 1):
                raise ValueError(f"itemsize {size} is not a power of two")
            pos += b
            segs.append((pos, size))
        ends.append(segs)
    total = [segs[-1][0] for segs in ends]
    load: dict[int, int] = {}
    for (s, d), t in zip(pairs, total):
        load[s] = load.get(s, 0) + t
        load[d] = load.get(d, 0) + t
    busiest = max(load.values(), default=0)
    if -(-busiest // budget) > MAX_ROUNDS:
        raise ValueError(
            f"a staging budget of {budget} bytes needs at least {-(-busiest // budget)} rounds for a rank that "
            f"moves {busiest} bytes; give a budget of at least {-(-busiest // MAX_ROUNDS)} bytes"
        )
    offset = [0] * len(pairs)
    active = list(range(len(pairs)))
    rounds = []
    while active:
        # Busiest rank first; among equals the pair furthest behind in its stream (in 1/1024ths), so that a
        # rank's streams walk through the states together and a state is not half-moved for long.
        active.sort(key=lambda i: (-max(load[pairs[i][0]], load[pairs[i][1]]),
                                   (offset[i] << 10) // total[i], pairs[i]))
        room: dict[int, int] = {}
        degree: dict[int, int] = {}
        for i in active:
            for r in pairs[i]:
                degree[r] = degree.get(r, 0) + 1
        start = {i: offset[i] for i in active}
        # Two passes: first a fair share of each end's budget, so a rank sends and receives in the same round
        # (links are full duplex) instead of one direction taking the whole round; then what room is left.
        for fair_pass in (True, False):
            for i in active:
                s, d = pairs[i]
                want = min(room.get(s, budget), room.get(d, budget), total[i] - offset[i])
                if fair_pass:
                    want = min(want, max(need, budget // max(degree[s], degree[d])))
                if want <= 0:
                    continue
                n = _snap(ends[i], offset[i] + want) - offset[i]
                if n <= 0:
                    continue
                offset[i] += n
                room[s] = room.get(s, budget) - n
                room[d] = room.get(d, budget) - n
                load[s] -= n
                load[d] -= n
        taken = [(*pairs[i], start[i], offset[i] - start[i]) for i in active if offset[i] > start[i]]
        rounds.append(tuple(sorted(taken)))
        active = [i for i in active if offset[i] < total[i]]
    return tuple(rounds)


def _snap(segs: list[tuple[int, int]], x: int) -> int:
    """The largest element boundary <= x in a stream with segments [(end, itemsize)]."""
    start = 0
    for end, size in segs:
        if x < end:
            return start + (x - start) // size * size
        start = end
    return start


@dataclass(frozen=True)
class Message:
    """One coalesced buffer from ``src`` to ``dst`` in one round: ``pieces`` packed in this order, each
    row-major, back to back (every piece starts at a multiple of its itemsize)."""

    round: int
    src: int
    dst: int
    nbytes: int
    pieces: tuple[Transfer, ...]


@dataclass(frozen=True)
class Round:
    index: int
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class RankPlan:
    """Everything one process does in a switch. Per round k, in this order: allocate the destination
    shards whose ``alloc_round`` is k, pack and post all ``sends[k]`` and ``recvs[k]`` together, wait,
    unpack, run ``local_copies[k]``, then free the source shards whose ``release_round`` is k.

    ``release_round[(state, shard)]`` is -1 for a source shard nothing reads (free it before round 0).
    """

    rank: int
    num_rounds: int
    sends: tuple[tuple[Message, ...], ...]
    recvs: tuple[tuple[Message, ...], ...]
    local_copies: tuple[tuple[Transfer, ...], ...]
    release_round: dict
    alloc_round: dict

    def staging_bytes(self, k: int) -> int:
        return sum(m.nbytes for m in self.sends[k]) + sum(m.nbytes for m in self.recvs[k])

    def state_alloc_round(self) -> dict[str, int]:
        """Per state, when to allocate the whole local tensor (its earliest shard)."""
        out: dict[str, int] = {}
        for (state, _), k in self.alloc_round.items():
            out[state] = min(out.get(state, k), k)
        return out

    def state_release_round(self) -> dict[str, int]:
        """Per state, after which round the whole old local tensor can be freed (its latest shard)."""
        out: dict[str, int] = {}
        for (state, _), k in self.release_round.items():
            out[state] = max(out.get(state, k), k)
        return out


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
    traffic: tuple[tuple[Slice, ...], ...]
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
        return sum(n for rnd in self.traffic for _, _, _, n in rnd)

    def rank_bytes(self) -> tuple[dict[int, int], dict[int, int]]:
        """(bytes sent, bytes received) per process over the whole switch."""
        sent: dict[int, int] = {}
        recv: dict[int, int] = {}
        for rnd in self.traffic:
            for s, d, _, n in rnd:
                sent[s] = sent.get(s, 0) + n
                recv[d] = recv.get(d, 0) + n
        return sent, recv

    @property
    def peak_staging_bytes(self) -> int:
        peak = 0
        for rnd in self.traffic:
            use: dict[int, int] = {}
            for s, d, _, n in rnd:
                use[s] = use.get(s, 0) + n
                use[d] = use.get(d, 0) + n
            peak = max(peak, max(use.values(), default=0))
        return peak

    # ----- per rank
    def rank_plan(self, rank: int) -> RankPlan:
        plan = self._cache.get(rank)
        if plan is None:
            plan = self._cache[rank] = _expand_rank(self, rank)
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
        h.update(repr((self.assignment, self.budget_bytes, self.traffic)).encode())
        for p in self.processes if ranks is None else ranks:
            rp = self.rank_plan(p)
            h.update(repr((rp.rank, rp.num_rounds, rp.sends, rp.recvs, rp.local_copies,
                           sorted(rp.release_round.items()), sorted(rp.alloc_round.items()))).encode())
        return h.hexdigest()


def _stream_key(plan: SwitchPlan, t: Transfer) -> tuple:
    spec_index = plan.table.old.state_index(t.state)
    return (plan.group_of(spec_index), -plan.table.old.states[spec_index].itemsize, spec_index, t.dst_shard,
            t.dst_box.lo)


def _cut(pieces: list[Transfer], itemsize: dict[str, int], slices: list[tuple[int, int, int]],
         src: int, dst: int) -> list[Message]:
    """Split an ordered stream of pieces at the (round, offset, bytes) slices the schedule chose."""
    out = []
    i, pos = 0, 0  # piece index, stream offset where piece i starts
    for k, off, n in slices:
        end = off + n
        got: list[Transfer] = []
        while i < len(pieces) and pos < end:
            t = pieces[i]
            size = itemsize[t.state]
            a, b = max(off, pos), min(end, pos + t.nbytes)
            if a == pos and b == pos + t.nbytes:
                got.append(t)
            else:
                e0, e1 = (a - pos) // size, (b - pos) // size
                for sb, db in zip(t.src_box.element_range(e0, e1), t.dst_box.element_range(e0, e1)):
                    got.append(Transfer(t.src, t.dst, t.state, t.src_shard, sb, t.dst_shard, db, sb.numel * size))
            if b == pos + t.nbytes:
                pos += t.nbytes
                i += 1
            else:
                break
        if sum(t.nbytes for t in got) != n:
            raise RuntimeError(f"pair {src}->{dst}: round {k} slice of {n} bytes does not match the stream")
        out.append(Message(k, src, dst, n, tuple(got)))
    return out


def _pair_slices(plan: SwitchPlan) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    index = plan._cache.get("slices")
    if index is None:
        index = {}
        for k, rnd in enumerate(plan.traffic):
            for s, d, off, n in rnd:
                index.setdefault((s, d), []).append((k, off, n))
        plan._cache["slices"] = index
    return index


def _local_bytes(layout: Layout, state: str, process: int) -> int:
    held = layout.shards(state, process)
    return 0 if held is None else held.numel * layout.state(state).itemsize


def _copy_round(last_send: int | None, first_recv: int | None, span: tuple[int, int],
                src_bytes: int, dst_bytes: int) -> int:
    """The round of a state's local copies, inside its phase's rounds ``span`` = [start, end). The source
    tensor lives until max(last send, copy round), the destination from min(first receive, copy round); pick
    the round (among the phase's first and last, the last send and the first receive) that holds the fewest
    byte-rounds, earliest on ties. So a shrinking state swaps early, a growing one late, and a copy between
    the state's sends and receives costs nothing."""
    start, end = span
    s = start - 1 if last_send is None else last_send
    r = end if first_recv is None else first_recv

    def cost(c: int) -> int:
        return src_bytes * (max(s, c) + 1 - start) + dst_bytes * (end - min(r, c))

    options = sorted({start, end - 1, *(x for x in (last_send, first_recv) if x is not None)})
    return min(options, key=lambda c: (cost(c), c))


def _expand_rank(plan: SwitchPlan, rank: int) -> RankPlan:
    table = plan.table
    itemsize = {s.name: s.itemsize for s in table.old.states}
    sends, recvs, local = table.transfers(rank)
    slices = _pair_slices(plan)
    n_rounds = plan.num_rounds
    out_send: list[list[Message]] = [[] for _ in range(n_rounds)]
    out_recv: list[list[Message]] = [[] for _ in range(n_rounds)]
    for transfers, box in ((sends, out_send), (recvs, out_recv)):
        by_pair: dict[tuple[int, int], list[Transfer]] = {}
        for t in transfers:
            by_pair.setdefault((t.src, t.dst), []).append(t)
        for pair in sorted(by_pair):
            stream = sorted(by_pair[pair], key=lambda t: _stream_key(plan, t))
            for msg in _cut(stream, itemsize, slices.get(pair, []), *pair):
                box[msg.round].append(msg)
    last_send: dict[tuple[str, int], int] = {}
    for k, msgs in enumerate(out_send):
        for m in msgs:
            for t in m.pieces:
                last_send[(t.state, t.src_shard)] = k
    first_recv: dict[tuple[str, int], int] = {}
    for k, msgs in enumerate(out_recv):
        for m in msgs:
            for t in m.pieces:
                first_recv.setdefault((t.state, t.dst_shard), k)
    # All local copies of a state run in one round, chosen per state (the engine allocates and frees whole
    # local tensors): see `_copy_round`.
    state_last_send: dict[str, int] = {}
    for (name, _), k in last_send.items():
        state_last_send[name] = max(state_last_send.get(name, k), k)
    state_first_recv: dict[str, int] = {}
    for (name, _), k in first_recv.items():
        state_first_recv[name] = min(state_first_recv.get(name, k), k)
    copy_round: dict[str, int] = {}
    for t in local:
        if t.state not in copy_round:
            copy_round[t.state] = _copy_round(
                state_last_send.get(t.state), state_first_recv.get(t.state),
                plan.group_span(table.old.state_index(t.state)),
                _local_bytes(table.old, t.state, rank), _local_bytes(table.new, t.state, rank))
    copies: list[list[Transfer]] = [[] for _ in range(n_rounds)]
    copy_rounds: list[tuple[Transfer, int]] = []
    for t in local:
        k = copy_round[t.state]
        copies[k].append(t)
        copy_rounds.append((t, k))
    release: dict[tuple[str, int], int] = {}
    pos = table.old.position_of(rank)
    if pos is not None:
        for spec, c in zip(table.old.states, table.old.state_class):
            for i in range(len(table.old.classes[c][pos].boxes)):
                release[(spec.name, i)] = last_send.get((spec.name, i), -1)
    for t, k in copy_rounds:
        key = (t.state, t.src_shard)
        release[key] = max(release.get(key, -1), k)
    alloc: dict[tuple[str, int], int] = dict(first_recv)
    for t, k in copy_rounds:
        key = (t.state, t.dst_shard)
        alloc[key] = min(alloc.get(key, k), k)
    npos = table.new.position_of(rank)
    if npos is not None:
        for spec, c in zip(table.new.states, table.new.state_class):
            for i in range(len(table.new.classes[c][npos].boxes)):
                if (spec.name, i) not in alloc:
                    raise RuntimeError(f"rank {rank}: shard {i} of {spec.name!r} receives no data")
    return RankPlan(
        rank, n_rounds, tuple(tuple(m) for m in out_send), tuple(tuple(m) for m in out_recv),
        tuple(tuple(c) for c in copies), release, alloc,
    )


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


def staging_share(budget_bytes: int) -> int:
    """Half the budget stages a round's messages; the other half holds the phase in flight."""
    return (budget_bytes + 1) // 2


def schedule_groups(table: RouteTable, groups: tuple[tuple[int, ...], ...], budget_bytes: int):
    """Rounds for the phases one after another: (traffic, rounds [start, end) of each phase).

    A phase with nothing on the wire still gets one round, where its local copies run. Stream offsets run on
    across phases, so a pair's stream is its phases' streams back to back (`_stream_key` sorts by phase).
    """
    staging = staging_share(budget_bytes)
    need = min_budget(table.pair_bytes)
    if staging < need:
        raise ValueError(
            f"a switch budget of {budget_bytes} bytes leaves {staging} bytes to stage a round, less than the "
            f"largest indivisible piece (one element of {need} bytes): give a budget of at least {2 * need - 1} bytes"
        )
    load: dict[int, int] = {}
    for (s, d), segs in table.pair_bytes.items():
        n = sum(b for _, b in segs)
        load[s] = load.get(s, 0) + n
        load[d] = load.get(d, 0) + n
    busiest = max(load.values(), default=0)
    if -(-busiest // staging) + len(groups) > MAX_ROUNDS:
        raise ValueError(
            f"a switch budget of {budget_bytes} bytes needs more than {MAX_ROUNDS} rounds for a rank that moves "
            f"{busiest} bytes; give a budget of at least {2 * -(-busiest // (MAX_ROUNDS - len(groups)))} bytes"
        )
    traffic: list[tuple[Slice, ...]] = []
    spans = []
    base: dict[tuple[int, int], int] = {}
    for members in groups:
        pair_bytes = table.group_pair_bytes(members)
        start = len(traffic)
        for rnd in schedule_pairs(pair_bytes, staging) if pair_bytes else ():
            traffic.append(tuple((s, d, base.get((s, d), 0) + off, n) for s, d, off, n in rnd))
        for pair, segs in pair_bytes.items():
            base[pair] = base.get(pair, 0) + sum(b for _, b in segs)
        if len(traffic) == start:
            traffic.append(())
        spans.append((start, len(traffic)))
    return tuple(traffic), tuple(spans)
