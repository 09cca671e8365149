"""Run one rank's part of a `SwitchPlan` on a process group: the only layer that moves bytes.

Inputs are this process's *local tensors* of the old layout (state name -> tensor of the position's
``local_shape``; a fused projection's several boxes are views into that one tensor at their ``offsets``).
The output is the local tensors of the new layout. Per round ``k``::

    split every message into operations (`engine.wire`): a large piece that is one contiguous run of its
        local tensor on either side travels alone and in place on that side; the others share a packed one
    pack the strided sends into their slots of the staging buffer
    free the source tensors whose last use was that packing (those the wire reads in place: after the wait)
    post all sends and receives of round k at once (one batch_isend_irecv)
    run the local copies of round k meanwhile (allocate a destination on first use, free a source on last)
    wait, then unpack the staged receives into their destinations

The staging buffer is allocated once, sized by the largest round's staged operations (each slot 16-byte
aligned), and reused. A message's pieces are packed back to back in the plan's
order; the planner sorts them largest itemsize first, so a piece starts at a multiple of its itemsize and
the receiver views the bytes as the piece's dtype without a copy. Mixed dtypes in one message are fine.

Memory: live bytes = live sources + live destinations + staging, tracked at every allocation and free and
returned as ``peak_bytes``. Sources are dropped from the caller's dict (the engine takes ownership), so the
memory really goes back to the allocator when the caller holds no other reference.

Nothing here knows the device: CPU tensors with gloo, CUDA tensors with NCCL (CUDA phases are synchronised
for timing only).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from dynatrain.engine.wire import WireOp, split_message
from dynatrain.planner.routing import Transfer
from dynatrain.planner.schedule import SwitchPlan
from dynatrain.vps.box import Box
from dynatrain.vps.layout import Layout

ALIGN = 16  # bytes: every message slot of the staging buffer starts at a multiple of this

_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool, "complex64": torch.complex64,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout dtype name ("float32", "bfloat16", ...)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"no torch dtype for layout dtype {name!r}; known: {', '.join(_DTYPES)}") from None


class TransitionError(RuntimeError):
    """The engine cannot run this plan with the tensors it was given (raised before any byte moves)."""


@dataclass
class TransitionStats:
    """What one rank did in a switch. Bytes are payload bytes (no alignment padding)."""

    rank: int
    rounds: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0  # copied locally (src == dst process), never on the wire
    bytes_kept: int = 0  # local tensors adopted as they are (same box, same shape): no copy at all
    bytes_zero_copy: int = 0  # sent from or received into the local tensor itself, no staging on this side
    src_bytes: int = 0  # this rank's old local tensors
    dst_bytes: int = 0  # this rank's new local tensors
    staging_bytes: int = 0  # the one staging buffer
    flight_bytes: int = 0  # what a phase may hold doubled: half the budget, or this rank's largest local tensor
    peak_bytes: int = 0  # max over the switch of live sources + live destinations + staging
    seconds_pack: float = 0.0
    seconds_wire: float = 0.0  # posting and waiting (local copies run while the wire is busy)
    seconds_local: float = 0.0
    seconds_unpack: float = 0.0
    seconds_total: float = 0.0

    @property
    def peak_bound(self) -> int:
        """The bound the engine keeps: max(sources, destinations) + staging + the phase in flight."""
        return max(self.src_bytes, self.dst_bytes) + self.staging_bytes + self.flight_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d["peak_bound"] = self.peak_bound
        return d


# ----------------------------------------------------------------------------------------- validation
def _box_view(t: torch.Tensor, origin: tuple[int, ...], box: Box) -> torch.Tensor:
    """``box`` (in the coordinates of the shard at ``origin`` inside local tensor ``t``) as a view of t."""
    return t[tuple(slice(o + l, o + h) for o, l, h in zip(origin, box.lo, box.hi))]


def expected_sources(plan: SwitchPlan, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """state -> (local shape, dtype name) of every old local tensor ``rank`` holds (empty: holds none)."""
    return _expected(plan.old, rank)


def expected_destinations(plan: SwitchPlan, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """state -> (local shape, dtype name) of every new local tensor ``rank`` will hold."""
    return _expected(plan.new, rank)


def _expected(layout: Layout, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    if layout.position_of(rank) is None:
        return out
    for spec in layout.states:
        out[spec.name] = (tuple(layout.shards(spec.name, rank).local_shape), spec.dtype)
    return out


def validate_sources(plan: SwitchPlan, rank: int, src: Mapping[str, torch.Tensor]) -> None:
    """Raise TransitionError naming the first source tensor that is missing or has the wrong shape, dtype
    or device. Purely local: a caller that must keep all ranks in step all-reduces the outcome itself."""
    device = None
    for name, (shape, dtype) in expected_sources(plan, rank).items():
        t = src.get(name)
        numel = 1
        for d in shape:
            numel *= d
        if t is None:
            if numel == 0:
                continue  # an empty shard carries nothing: tolerate its absence
            raise TransitionError(
                f"rank {rank}: no source tensor for state {name!r}; the old layout gives this rank a local "
                f"tensor of shape {shape} and dtype {dtype}"
            )
        if not isinstance(t, torch.Tensor):
            raise TransitionError(f"rank {rank}: source of state {name!r} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != shape:
            raise TransitionError(
                f"rank {rank}: source tensor of state {name!r} has shape {tuple(t.shape)}, the old layout "
                f"gives this rank shape {shape}"
            )
        if t.dtype != torch_dtype(dtype):
            raise TransitionError(
                f"rank {rank}: source tensor of state {name!r} has dtype {t.dtype}, the layout says {dtype}"
            )
        if numel and device is not None and t.device != device:
            raise TransitionError(
                f"rank {rank}: source tensors live on {device} and {t.device} (state {name!r}): use one device"
            )
        if numel:
            device = t.device


# ----------------------------------------------------------------------------------------- the engine
class _Live:
    """Live-byte accounting: sources + destinations + staging, with the running peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.now += n
        if self.now > self.peak:
            self.peak = self.now

    def sub(self, n: int) -> None:
        self.now -= n


def _resolve_peers(group_ranks: Mapping[int, int] | Sequence[int] | Callable[[int], int] | None) -> Callable[[int], int]:
    if group_ranks is None:
        return lambda p: p
    if callable(group_ranks) and not isinstance(group_ranks, Mapping):
        return group_ranks
    table = group_ranks

    def peer(p: int) -> int:
        try:
            return table[p]
        except (KeyError, IndexError):
            raise TransitionError(f"process {p} of the plan has no rank in the process group mapping") from None

    return peer


def run_transition(
    plan: SwitchPlan,
    rank: int,
    src: MutableMapping[str, torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    group_ranks: Mapping[int, int] | Sequence[int] | Callable[[int], int] | None = None,
    device: torch.device | str | None = None,
    keep_in_place: bool = True,
) -> tuple[dict[str, torch.Tensor], TransitionStats]:
    """Run process ``rank``'s part of ``plan`` and return (its new local tensors, stats).

    ``src``: state name -> old local tensor of this process (shape ``plan.old.shards(name, rank).local_shape``,
    the layout's dtype). The engine **consumes** it: each entry is popped as soon as its last piece is packed
    or copied (pass a copy of the dict to keep your references, at the cost of the memory bound).
    ``group``: the process group every process of the plan belongs to (default: the world).
    ``group_ranks``: plan process id -> rank in ``group`` (mapping, sequence or callable); default identity.
    ``device``: where destinations and the staging buffer live; default the device of the sources (CPU for a
    process that holds none). ``keep_in_place``: adopt a source tensor as the destination when the new local
    tensor is exactly the old one (same shape, every element stays where it is): no copy, no extra memory.

    Every process of ``plan.processes`` must call this with the same plan; a process with nothing to move
    still returns (it posts nothing). Returns destinations for every state of the new layout this process
    holds (an empty dict for a process without a new position).
    """
    t_start = time.perf_counter()
    validate_sources(plan, rank, src)
    rp = plan.rank_plan(rank)
    if device is None:
        device = next((t.device for t in src.values() if isinstance(t, torch.Tensor) and t.numel()), None)
        device = device or torch.device("cpu")
    device = torch.device(device)
    cuda = device.type == "cuda"
    peer_of = _resolve_peers(group_ranks)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    old, new = plan.old, plan.new
    src_shards = {name: old.shards(name, rank) for name in expected_sources(plan, rank)}
    dst_spec = expected_destinations(plan, rank)
    dst_shards = {name: new.shards(name, rank) for name in dst_spec}
    stats = TransitionStats(rank=rank, rounds=rp.num_rounds)

    # Remaining uses per source state (pieces packed or copied) and whether a destination is allocated.
    uses: dict[str, int] = {name: 0 for name in src_shards}
    for k in range(rp.num_rounds):
        for m in rp.sends[k]:
            for t in m.pieces:
                uses[t.state] += 1
        for t in rp.local_copies[k]:
            uses[t.state] += 1

    live = _Live()
    for name in src_shards:
        t = src.get(name)
        if t is not None:
            stats.src_bytes += t.numel() * t.element_size()
    live.add(stats.src_bytes)
    largest = max((t.numel() * t.element_size() for t in src.values() if isinstance(t, torch.Tensor)), default=0)
    for name, (shape, dtype) in dst_spec.items():
        n = 1
        for d in shape:
            n *= d
        stats.dst_bytes += n * torch_dtype(dtype).itemsize
        largest = max(largest, n * torch_dtype(dtype).itemsize)
    stats.flight_bytes = max(plan.budget_bytes - plan.staging_budget_bytes, largest)

    dst: dict[str, torch.Tensor] = {}

    def free_source(name: str) -> None:
        t = src.pop(name, None)
        if t is not None and name not in kept:
            live.sub(t.numel() * t.element_size())
        del t

    def get_dst(name: str) -> torch.Tensor:
        t = dst.get(name)
        if t is None:
            shape, dtype = dst_spec[name]
            t = dst[name] = torch.empty(shape, dtype=torch_dtype(dtype), device=device)
            live.add(t.numel() * t.element_size())
        return t

    # In-place adoption: the new local tensor is the old one (same shape, every element it needs is a local
    # copy onto the same local coordinates). Sends may still read it: adopting changes no byte.
    kept: set[str] = set()
    if keep_in_place:
        recv_states = {t.state for ms in rp.recvs for m in ms for t in m.pieces}
        copies_by_state: dict[str, list[Transfer]] = {}
        for ts in rp.local_copies:
            for t in ts:
                copies_by_state.setdefault(t.state, []).append(t)
        for name, ts in copies_by_state.items():
            if name in recv_states or name not in src or name not in dst_shards:
                continue
            s_sh, d_sh = src_shards[name], dst_shards[name]
            if tuple(s_sh.local_shape) != tuple(d_sh.local_shape):
                continue
            same = all(
                _local_box(s_sh.offsets[t.src_shard], t.src_box) == _local_box(d_sh.offsets[t.dst_shard], t.dst_box)
                for t in ts
            )
            if same and sum(t.dst_box.numel for t in ts) == src[name].numel():
                dst[name] = src[name]  # the same bytes, from now on counted as a destination
                kept.add(name)
                uses[name] -= len(ts)
                stats.bytes_kept += sum(t.nbytes for t in ts)
    for name in [n for n, c in uses.items() if c == 0]:
        free_source(name)  # nothing (more) reads it
    # Destinations with no element: allocate now (zero bytes), so every state comes back.
    for name, sh in dst_shards.items():
        if sh.numel == 0:
            get_dst(name)

    # Per round, the operations on the wire (pieces sent or received in place, the rest packed), and the
    # staging buffer once, for the largest round's packed operations.
    wire = [([op for m in rp.sends[k] for op in split_message(m, old, new, m.dst)],
             [op for m in rp.recvs[k] for op in split_message(m, old, new, m.src)]) for k in range(rp.num_rounds)]

    def slots(ops: list[WireOp], start: int, staged) -> tuple[list[int], int]:
        offs, pos = [], start
        for op in ops:
            offs.append(pos)
            if staged(op):
                pos += -(-op.nbytes // ALIGN) * ALIGN
        return offs, pos

    def send_staged(op: WireOp) -> bool:
        return not op.src_direct

    def recv_staged(op: WireOp) -> bool:
        return not op.dst_direct

    size = 0
    for sends, recvs in wire:
        _, end = slots(sends, 0, send_staged)
        _, end = slots(recvs, end, recv_staged)
        size = max(size, end)
    staging = torch.empty(size, dtype=torch.uint8, device=device)
    stats.staging_bytes = size
    live.add(size)
    dtypes = {s.name: torch_dtype(s.dtype) for s in old.states}

    def in_place(view: torch.Tensor) -> torch.Tensor:
        if not view.is_contiguous():  # the plan's geometry and torch's disagree: never send the wrong bytes
            raise TransitionError(f"rank {rank}: a piece planned as contiguous is a strided view {view.stride()}")
        return view.reshape(-1).view(torch.uint8)

    for k, (sends, recvs) in enumerate(wire):
        send_offs, end = slots(sends, 0, send_staged)
        recv_offs, _ = slots(recvs, end, recv_staged)
        # --- pack what is strided on this side; the rest is sent from the source tensor itself
        t0 = time.perf_counter()
        exhausted: list[str] = []
        on_wire: set[str] = set()  # sources the wire reads in place: freed only after the wait
        buffers = []
        for op, off in zip(sends, send_offs):
            if op.src_direct:
                [t] = op.pieces
                buffers.append(in_place(_box_view(src[t.state], src_shards[t.state].offsets[t.src_shard], t.src_box)))
                on_wire.add(t.state)
            else:
                pos = off
                for t in op.pieces:
                    view = _box_view(src[t.state], src_shards[t.state].offsets[t.src_shard], t.src_box)
                    staging[pos:pos + t.nbytes].view(dtypes[t.state]).view(view.shape).copy_(view)
                    pos += t.nbytes
                    del view
                buffers.append(staging[off:off + op.nbytes])
            for t in op.pieces:
                uses[t.state] -= 1
                if uses[t.state] == 0:
                    exhausted.append(t.state)
            stats.bytes_sent += op.nbytes
            stats.bytes_zero_copy += op.nbytes if op.src_direct else 0
        sync()
        for name in exhausted:
            if name not in on_wire:
                free_source(name)
        t1 = time.perf_counter()
        stats.seconds_pack += t1 - t0
        # --- wire (local copies run while it is busy)
        ops = [dist.P2POp(dist.isend, b, group=group, group_peer=peer_of(op.peer)) for op, b in zip(sends, buffers)]
        for op, off in zip(recvs, recv_offs):
            if op.dst_direct:
                [t] = op.pieces
                b = in_place(_box_view(get_dst(t.state), dst_shards[t.state].offsets[t.dst_shard], t.dst_box))
                stats.bytes_zero_copy += op.nbytes
            else:
                b = staging[off:off + op.nbytes]
            ops.append(dist.P2POp(dist.irecv, b, group=group, group_peer=peer_of(op.peer)))
        works = dist.batch_isend_irecv(ops) if ops else []
        t2 = time.perf_counter()
        for t in _copy_order(rp.local_copies[k], kept, uses, src, dst, dst_spec):
            s_sh, d_sh = src_shards[t.state], dst_shards[t.state]
            out = _box_view(get_dst(t.state), d_sh.offsets[t.dst_shard], t.dst_box)
            out.copy_(_box_view(src[t.state], s_sh.offsets[t.src_shard], t.src_box))
            del out
            stats.bytes_local += t.nbytes
            uses[t.state] -= 1
            if uses[t.state] == 0 and t.state not in on_wire:
                free_source(t.state)
        sync()
        t3 = time.perf_counter()
        stats.seconds_local += t3 - t2
        for w in works:
            w.wait()
        sync()
        t4 = time.perf_counter()
        stats.seconds_wire += (t2 - t1) + (t4 - t3)
        del ops, works, buffers
        for name in on_wire:
            if uses[name] == 0:
                free_source(name)
        # --- unpack what arrived in the staging buffer
        for op, off in zip(recvs, recv_offs):
            if not op.dst_direct:
                pos = off
                for t in op.pieces:
                    d_sh = dst_shards[t.state]
                    out = _box_view(get_dst(t.state), d_sh.offsets[t.dst_shard], t.dst_box)
                    out.copy_(staging[pos:pos + t.nbytes].view(dtypes[t.state]).view(out.shape))
                    pos += t.nbytes
                    del out
            stats.bytes_received += op.nbytes
        sync()
        stats.seconds_unpack += time.perf_counter() - t4
        stats.messages_sent += len(rp.sends[k])
        stats.messages_received += len(rp.recvs[k])

    del staging
    live.sub(size)
    leftover = [name for name in src_shards if name in src]
    if leftover:  # a plan bug: every source should have been read to the end
        raise TransitionError(f"rank {rank}: source tensors {leftover} were never fully read by the plan")
    missing = [name for name in dst_spec if name not in dst]
    if missing:
        raise TransitionError(f"rank {rank}: the plan delivered nothing into destination tensors {missing}")
    stats.peak_bytes = live.peak
    stats.seconds_total = time.perf_counter() - t_start
    return dst, stats


def _local_box(origin: tuple[int, ...], box: Box) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(o + l for o, l in zip(origin, box.lo)), tuple(o + h for o, h in zip(origin, box.hi))


def _copy_order(copies, kept, uses, src, dst, dst_spec) -> list[Transfer]:
    """The round's local copies grouped by state, states that free more than they allocate first, so a
    shrinking state never waits behind a growing one (the peak of a local-only switch is then at most the
    sources plus one destination tensor)."""
    groups: dict[str, list[Transfer]] = {}
    for t in copies:
        if t.state not in kept:  # kept states were adopted in place before round 0
            groups.setdefault(t.state, []).append(t)

    def net(name: str) -> int:
        grow = 0
        if name not in dst:
            shape, dtype = dst_spec[name]
            grow = torch_dtype(dtype).itemsize
            for d in shape:
                grow *= d
        s = src.get(name)
        free = s.numel() * s.element_size() if s is not None and uses[name] == len(groups[name]) else 0
        return grow - free

    order = sorted(groups, key=net)
    return [t for name in order for t in groups[name]]
