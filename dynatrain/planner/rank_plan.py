"""One process's part of a switch: its pieces, cut at the rounds' slices, and when it allocates and frees.

The rank expands only its own pairs into pieces and cuts each stream at the slice boundaries the rounds chose. Both
ends of a pair build the same stream from the same table, so they cut it identically without talking.

Stream order: pieces sorted by phase, itemsize (largest first), then state order, then destination shard and box.
Largest-first means every piece starts at a byte offset that is a multiple of its own itemsize (all itemsizes are
powers of two), so a cut snaps to an element boundary knowing only the bytes per itemsize, and the receiver can
view its buffer as the piece's dtype without a copy. State order means every pair walks through the states in the
same order, so a source shard is finished (and freed) roughly when all pairs have passed its state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynatrain.planner.routing import Transfer
from dynatrain.vps.layout import Layout


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


def _stream_key(plan, t: Transfer) -> tuple:
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


def _rank_slices(plan, rank: int) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """The (round, stream offset, bytes) slices of every pair ``rank`` sends or receives on."""
    out: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for k, rnd in enumerate(plan.traffic):
        src, dst = np.asarray(rnd.src), np.asarray(rnd.dst)
        for i in np.flatnonzero((src == rank) | (dst == rank)).tolist():
            out.setdefault((int(src[i]), int(dst[i])), []).append((k, int(rnd.offset[i]), int(rnd.nbytes[i])))
    return out


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


def expand_rank(plan, rank: int) -> RankPlan:
    table = plan.table
    itemsize = {s.name: s.itemsize for s in table.old.states}
    sends, recvs, local = table.transfers(rank)
    slices = _rank_slices(plan, rank)
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
