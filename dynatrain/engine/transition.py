"""Run one rank's part of a `SwitchPlan` on a process group: the only layer that moves bytes.

Inputs are this process's *local tensors* of the old layout (state name -> tensor of the position's
``local_shape``; a fused projection's several boxes are views into that one tensor at their ``offsets``).
The output is the local tensors of the new layout. Per round ``k``::

    split every message into operations (`engine.wire`): a large piece that is one contiguous run of its
        local tensor on either side travels alone and in place on that side; the others share a packed one
    pack the strided sends into their slots of the staging buffer
    free the source tensors whose last use was that packing (those the wire reads in place: after the wait)
    post all sends and receives of round k at once (one batch_isend_irecv: NCCL needs a round as one group)
    run the local copies of round k meanwhile (allocate a destination on first use, free a source on last)
    wait, then unpack the staged receives into their destinations

On gloo a round may instead be streamed (``streamed=True``): every receive posted first, each send posted as soon
as it is packed, each receive unpacked as soon as it has arrived.

The staging buffer is allocated once, sized by the largest round's staged operations (each slot 16-byte
aligned), and reused. A message's pieces are packed back to back in the plan's
order; the planner sorts them largest itemsize first, so a piece starts at a multiple of its itemsize and
the receiver views the bytes as the piece's dtype without a copy. Mixed dtypes in one message are fine.

Memory: live bytes = live sources + live destinations + staging, tracked at every allocation and free and
returned as ``peak_bytes``. Sources are dropped from the caller's dict (the engine takes ownership) and their
storage emptied after their last use (`engine.storages`), so the memory goes back to the allocator even while
something else (a module's reference cycles) still holds the tensor object. On CUDA the bound is kept for the
caching allocator's reserved bytes too, and its peaks are reported (`engine.device_memory`).

Nothing here knows the device: CPU tensors with gloo, CUDA tensors with NCCL (CUDA phases are synchronised
for timing only).

Destinations are allocated when their first bytes arrive, which keeps the memory bound; on CPU that first write
also has the kernel map every page of the fresh memory, which makes a local copy into it about 2.5 times slower
("First touch" in docs/benchmarks.md). A process with memory to spare, a joining one above all (it holds no
sources), allocates them ahead with `allocate_destinations`, outside the stall, and passes them as
``preallocated``.

On CPU the copies run with fewer intra-op threads than the process has (`engine.copy_threads`).
"""

from __future__ import annotations

import mmap
import time
from collections import Counter
from collections.abc import Callable, Mapping, MutableMapping, Sequence

import torch
import torch.distributed as dist

from dynatrain.engine.checks import (
    TransitionError,
    expected_destinations,
    expected_sources,
    tensor_bytes,
    torch_dtype,
    validate_sources,
)
from dynatrain.engine.copy_threads import intra_op_threads
from dynatrain.engine.device_memory import DeviceMemory
from dynatrain.engine.local_copies import copy_order, states_kept_in_place
from dynatrain.engine.rounds import Round
from dynatrain.engine.stats import LiveBytes, TransitionStats
from dynatrain.engine.storages import SourceStorages
from dynatrain.engine.wire import WireOp, box_view, in_place, round_slots, split_message
from dynatrain.planner.schedule import SwitchPlan

GroupRanks = Mapping[int, int] | Sequence[int] | Callable[[int], int] | None


def run_transition(
    plan: SwitchPlan,
    rank: int,
    src: MutableMapping[str, torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    group_ranks: GroupRanks = None,
    device: torch.device | str | None = None,
    keep_in_place: bool = True,
    preallocated: Mapping[str, torch.Tensor] | None = None,
    copy_threads: int | None = None,
    streamed: bool = False,
) -> tuple[dict[str, torch.Tensor], TransitionStats]:
    """Run process ``rank``'s part of ``plan`` and return (its new local tensors, stats).

    ``src``: state name -> old local tensor of this process (shape ``plan.old.shards(name, rank).local_shape``,
    the layout's dtype). The engine **consumes** it: each entry is popped as soon as its last piece is packed
    or copied, and its storage emptied unless a source still to be read or a destination lies on it too: any
    other reference to the tensor then holds one without bytes, which must not be read (clone what must outlive
    the call).
    ``group``: the process group every process of the plan belongs to (default: the world).
    ``group_ranks``: plan process id -> rank in ``group`` (mapping, sequence or callable); default identity.
    ``device``: where destinations and the staging buffer live; default the device of the sources (CPU for a
    process that holds none). ``keep_in_place``: adopt a source tensor as the destination when the new local
    tensor is exactly the old one (same shape, every element stays where it is): no copy, no extra memory. The
    plan's phases count such states as doubling nothing (`planner.groups`), so with it off the peak may pass the
    bound by their size.
    ``preallocated``: state name -> an empty destination allocated before the call (`allocate_destinations`),
    written in place instead of one allocated during the transfer; it counts as live from the start, so the
    memory bound is the caller's to keep. Each must have the new local shape, the dtype and the device.
    ``copy_threads``: intra-op threads for the copies on CPU during the transfer (default
    `copy_threads.default_copy_threads`); ignored on other devices.
    ``streamed``: each send posted as soon as it is packed and each receive unpacked as soon as it arrives, for gloo
    (NCCL needs a round as one group); default off: on 2 shared cores it was no faster (the transport's thread and
    the packing compete for the same cores: `bench/switch.py --engine-ways streamed,batched`, docs/benchmarks.md).

    Every process of ``plan.processes`` must call this with the same plan; a process with nothing to move
    still returns (it posts nothing). Returns destinations for every state of the new layout this process
    holds (an empty dict for a process without a new position).
    """
    t_start = time.perf_counter()
    validate_sources(plan, rank, src)
    run = _RankTransition(plan, rank, src, group, group_ranks, device)
    if streamed:
        if run.cuda:
            raise ValueError("streamed=True posts sends and receives one by one, which NCCL can deadlock on; "
                             "leave it off on CUDA")
        run.streamed = True
    if keep_in_place:
        run.keep_in_place()
    run.adopt_preallocated(preallocated or {})
    with intra_op_threads(run.device, copy_threads) as threads:
        run.stats.copy_threads = threads
        run.prepare()
        for k in range(run.rp.num_rounds):
            run.run_round(k)
    return run.finish(t_start)


def allocate_destinations(plan: SwitchPlan, rank: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every new local tensor of process ``rank``, empty, for `run_transition`'s ``preallocated``. On CPU each page
    is written once, so the kernel maps the memory now rather than while the bytes arrive."""
    device = torch.device(device)
    out = {}
    for name, (shape, dtype) in expected_destinations(plan, rank).items():
        t = out[name] = torch.empty(shape, dtype=torch_dtype(dtype), device=device)
        if device.type == "cpu" and t.numel():
            t.view(-1).view(torch.uint8)[::mmap.PAGESIZE].zero_()
    return out


class _RankTransition:
    """One rank's run of a plan: its sources and destinations, the uses left per source, the staging buffer and
    the live-byte count, advanced one round at a time."""

    def __init__(self, plan: SwitchPlan, rank: int, src: MutableMapping[str, torch.Tensor],
                 group: dist.ProcessGroup | None, group_ranks: GroupRanks, device) -> None:
        self.plan, self.rank, self.src, self.group = plan, rank, src, group
        self.rp = rp = plan.rank_plan(rank)
        if device is None:
            device = next((t.device for t in src.values() if isinstance(t, torch.Tensor) and t.numel()), None)
            device = device or torch.device("cpu")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.streamed = False
        self.peer_of = _resolve_peers(group_ranks)
        self.src_shards = {name: plan.old.shards(name, rank) for name in expected_sources(plan, rank)}
        self.dst_spec = expected_destinations(plan, rank)
        self.dst_shards = {name: plan.new.shards(name, rank) for name in self.dst_spec}
        self.stats = TransitionStats(rank=rank, rounds=rp.num_rounds)
        self.dst: dict[str, torch.Tensor] = {}
        self.kept: set[str] = set()  # sources adopted as their destination
        self.uses = self._count_uses()
        self.live = LiveBytes()
        self._count_bytes()

    # ---- set-up ---------------------------------------------------------------------------------------------
    def _count_uses(self) -> dict[str, int]:
        """Remaining uses per source state: pieces packed or copied."""
        rp = self.rp
        uses: dict[str, int] = {name: 0 for name in self.src_shards}
        for k in range(rp.num_rounds):
            for m in rp.sends[k]:
                for t in m.pieces:
                    uses[t.state] += 1
            for t in rp.local_copies[k]:
                uses[t.state] += 1
        return uses

    def _count_bytes(self) -> None:
        stats, src = self.stats, self.src
        for name in self.src_shards:
            t = src.get(name)
            if t is not None:
                stats.src_bytes += t.numel() * t.element_size()
        self.live.add(stats.src_bytes)
        largest = max((t.numel() * t.element_size() for t in src.values() if isinstance(t, torch.Tensor)),
                      default=0)
        for shape, dtype in self.dst_spec.values():
            stats.dst_bytes += tensor_bytes(shape, dtype)
            largest = max(largest, tensor_bytes(shape, dtype))
        stats.flight_bytes = max(self.plan.budget_bytes - self.plan.staging_budget_bytes, largest)

    def keep_in_place(self) -> None:
        """Adopt a source as its destination where `states_kept_in_place` allows. Sends may still read it: adopting
        changes no byte."""
        copies = Counter(t.state for ts in self.rp.local_copies for t in ts)
        for name in states_kept_in_place(self.plan, self.rank):
            if name in self.src:
                self.dst[name] = self.src[name]  # the same bytes, from now on counted as a destination
                self.kept.add(name)
                self.uses[name] -= copies[name]
                self.stats.bytes_kept += self.src[name].numel() * self.src[name].element_size()

    def adopt_preallocated(self, ready: Mapping[str, torch.Tensor]) -> None:
        """Take the caller's empty destinations (those not adopted in place from a source): live from now on."""
        for name, t in ready.items():
            if name not in self.dst_spec:
                raise TransitionError(f"rank {self.rank}: a preallocated tensor for state {name!r}, which this "
                                      f"process does not hold in the new layout")
            shape, dtype = self.dst_spec[name]
            if tuple(t.shape) != tuple(shape) or t.dtype != torch_dtype(dtype) or t.device != self.device \
                    or not t.is_contiguous():
                raise TransitionError(
                    f"rank {self.rank}: the preallocated tensor for state {name!r} is {tuple(t.shape)} {t.dtype} "
                    f"on {t.device}; the new layout needs a contiguous {tuple(shape)} {torch_dtype(dtype)} on "
                    f"{self.device} (allocate it with allocate_destinations)")
            if name not in self.dst:
                self.dst[name] = t
                self.live.add(t.numel() * t.element_size())

    def prepare(self) -> None:
        """Free what nothing reads, allocate the empty destinations, split every round into wire operations and
        allocate the staging buffer once, for the largest round's packed operations."""
        rp, old, new = self.rp, self.plan.old, self.plan.new
        self.wire = [([op for m in rp.sends[k] for op in split_message(m, old, new, m.dst)],
                      [op for m in rp.recvs[k] for op in split_message(m, old, new, m.src)])
                     for k in range(rp.num_rounds)]
        size = max((round_slots(sends, recvs)[2] for sends, recvs in self.wire), default=0)
        self.stats.staging_bytes = size
        # From here the bound holds for the allocator's reserved bytes too (a GPU's cache of freed blocks): measured
        # while every source is still held, so what the switch may add beyond them is the bound less the live bytes.
        self.device_memory = DeviceMemory(self.device, self.stats.peak_bound - self.live.now)
        self.storages = SourceStorages(self.src, self.src_shards, self.dst.values())
        for name in [n for n, c in self.uses.items() if c == 0]:
            self._free_source(name)  # nothing (more) reads it
        self.device_memory.make_room(size)
        self.staging = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.live.add(size)
        # Destinations with no element: allocate now (zero bytes), so every state comes back.
        for name, sh in self.dst_shards.items():
            if sh.numel == 0:
                self._get_dst(name)
        self.dtypes = {s.name: torch_dtype(s.dtype) for s in old.states}

    # ---- one round ------------------------------------------------------------------------------------------
    def run_round(self, k: int) -> None:
        if self.streamed:
            self._run_round_streamed(k)
        else:
            self._run_round_batched(k)

    def _round(self, k: int) -> Round:
        sends, recvs = self.wire[k]
        return Round(sends, recvs, (len(self.rp.sends[k]), len(self.rp.recvs[k])))

    def _run_round_batched(self, k: int) -> None:
        """Pack, post every send and receive at once, copy locally while the wire is busy, wait, unpack. NCCL needs
        the round as one group: its point-to-point kernels of one pair share a stream, so a send posted alone
        waits for the peer's receive, which may be queued behind that peer's own send."""
        r = self._round(k)
        with r.timed("pack"):
            buffers = self._pack(r.staged_sends, r.on_wire)
        ops, works = self._post(buffers, r)
        with r.timed("local"):
            self._copy_local(k, r.on_wire)
        for w in works:
            w.wait()
        self._sync()
        with r.timed("unpack"):
            del ops, works, buffers
            self._free_exhausted(r.on_wire)
            for op, off in r.staged_recvs:
                self._unpack_op(op, off)
            self._sync()
        r.close(self.stats)

    def _run_round_streamed(self, k: int) -> None:
        """The round with the copies beside the wire (gloo, whose transport thread writes and reads the sockets):
        every receive posted first; each send posted as soon as it is packed, so the next one is packed while it
        travels; the local copies; each receive unpacked as soon as it has arrived, in the plan's order, while
        the later ones are still arriving. Per pair, sends and receives keep the plan's order on both sides."""
        r = self._round(k)
        group, peer_of = self.group, self.peer_of
        receiving = [dist.irecv(self._recv_buffer(op, off), group=group, group_src=peer_of(op.peer))
                     for op, off in r.staged_recvs]
        sending, buffers = [], []
        for op, off in r.staged_sends:
            with r.timed("pack"):
                [buffer] = self._pack([(op, off)], r.on_wire)
            sending.append(dist.isend(buffer, group=group, group_dst=peer_of(op.peer)))
            buffers.append(buffer)
        with r.timed("local"):
            self._copy_local(k, r.on_wire)
        for (op, off), work in zip(r.staged_recvs, receiving):
            work.wait()
            with r.timed("unpack"):
                self._unpack_op(op, off)
        for work in sending:
            work.wait()
        r.close(self.stats)
        del sending, receiving, buffers
        self._free_exhausted(r.on_wire)

    def _pack_op(self, op: WireOp, off: int, on_wire: set[str], exhausted: list[str]) -> torch.Tensor:
        """The send buffer of ``op``: what is strided on this side packed into its slot of the staging buffer, else
        the source tensor itself (added to ``on_wire``: freed only after the wait). The sources whose last use this
        was go to ``exhausted``."""
        src, stats = self.src, self.stats
        if op.src_direct:
            [t] = op.pieces
            buffer = in_place(self.rank, box_view(src[t.state], self.src_shards[t.state].offsets[t.src_shard],
                                                  t.src_box))
            on_wire.add(t.state)
        else:
            pos = off
            for t in op.pieces:
                view = box_view(src[t.state], self.src_shards[t.state].offsets[t.src_shard], t.src_box)
                self.staging[pos:pos + t.nbytes].view(self.dtypes[t.state]).view(view.shape).copy_(view)
                pos += t.nbytes
                del view
            buffer = self.staging[off:off + op.nbytes]
        stats.bytes_sent += op.nbytes
        stats.bytes_zero_copy += op.nbytes if op.src_direct else 0
        for t in op.pieces:
            self.uses[t.state] -= 1
            if self.uses[t.state] == 0:
                exhausted.append(t.state)
        return buffer

    def _pack(self, staged: list[tuple[WireOp, int]], on_wire: set[str]) -> list[torch.Tensor]:
        """The send buffers of ``staged`` (operation, offset), packed; then the sources whose last use that was are
        freed, once the copies out of them are done (those the wire reads in place wait for it)."""
        exhausted: list[str] = []
        buffers = [self._pack_op(op, off, on_wire, exhausted) for op, off in staged]
        self._sync()
        for name in exhausted:
            if name not in on_wire:
                self._free_source(name)
        return buffers

    def _free_exhausted(self, on_wire: set[str]) -> None:
        """Free the sources the wire read in place whose last use has gone out."""
        for name in on_wire:
            if self.uses[name] == 0:
                self._free_source(name)

    def _recv_buffer(self, op: WireOp, off: int) -> torch.Tensor:
        """Where ``op``'s bytes arrive: its destination view when it is one contiguous run there, else its slot."""
        if op.dst_direct:
            [t] = op.pieces
            self.stats.bytes_zero_copy += op.nbytes
            return in_place(self.rank, box_view(self._get_dst(t.state), self.dst_shards[t.state].offsets[t.dst_shard],
                                                t.dst_box))
        return self.staging[off:off + op.nbytes]

    def _post(self, buffers: list[torch.Tensor], r: Round):
        """Post the round's sends (of ``buffers``) and receives in one batch; returns the operations (held until
        the wait) and their works."""
        group, peer_of = self.group, self.peer_of
        ops = [dist.P2POp(dist.isend, b, group=group, group_peer=peer_of(op.peer)) for op, b in zip(r.sends, buffers)]
        ops += [dist.P2POp(dist.irecv, self._recv_buffer(op, off), group=group, group_peer=peer_of(op.peer))
                for op, off in r.staged_recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        return ops, works

    def _copy_local(self, k: int, on_wire: set[str]) -> None:
        src, uses = self.src, self.uses
        for t in copy_order(self.rp.local_copies[k], self.kept, uses, src, self.dst, self.dst_spec):
            s_sh, d_sh = self.src_shards[t.state], self.dst_shards[t.state]
            out = box_view(self._get_dst(t.state), d_sh.offsets[t.dst_shard], t.dst_box)
            out.copy_(box_view(src[t.state], s_sh.offsets[t.src_shard], t.src_box))
            del out
            self.stats.bytes_local += t.nbytes
            uses[t.state] -= 1
            if uses[t.state] == 0 and t.state not in on_wire:
                self._free_source(t.state)
        self._sync()

    def _unpack_op(self, op: WireOp, off: int) -> None:
        """Copy what arrived in ``op``'s slot of the staging buffer into its destinations (queued on a GPU: the
        caller synchronises once for the round)."""
        if not op.dst_direct:
            pos = off
            for t in op.pieces:
                d_sh = self.dst_shards[t.state]
                out = box_view(self._get_dst(t.state), d_sh.offsets[t.dst_shard], t.dst_box)
                out.copy_(self.staging[pos:pos + t.nbytes].view(self.dtypes[t.state]).view(out.shape))
                pos += t.nbytes
                del out
        self.stats.bytes_received += op.nbytes

    # ---- the end --------------------------------------------------------------------------------------------
    def finish(self, t_start: float) -> tuple[dict[str, torch.Tensor], TransitionStats]:
        """Drop the staging buffer; check that every source was read and every destination written."""
        self.staging = None
        self.live.sub(self.stats.staging_bytes)
        rank = self.rank
        leftover = [name for name in self.src_shards if name in self.src]
        if leftover:  # a plan bug: every source should have been read to the end
            raise TransitionError(f"rank {rank}: source tensors {leftover} were never fully read by the plan")
        missing = [name for name in self.dst_spec if name not in self.dst]
        if missing:
            raise TransitionError(f"rank {rank}: the plan delivered nothing into destination tensors {missing}")
        self.stats.peak_bytes = self.live.peak
        for key, value in self.device_memory.figures().items():
            setattr(self.stats, key, value)
        self.stats.seconds_total = time.perf_counter() - t_start
        return self.dst, self.stats

    # ---- memory ---------------------------------------------------------------------------------------------
    def _free_source(self, name: str) -> None:
        t = self.src.pop(name, None)
        if t is not None:
            if name not in self.kept:
                self.live.sub(t.numel() * t.element_size())
            self.storages.done(name, t)
        del t

    def _get_dst(self, name: str) -> torch.Tensor:
        t = self.dst.get(name)
        if t is None:
            shape, dtype = self.dst_spec[name]
            self.device_memory.make_room(tensor_bytes(shape, dtype))
            t = self.dst[name] = torch.empty(shape, dtype=torch_dtype(dtype), device=self.device)
            self.live.add(t.numel() * t.element_size())
        return t

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _resolve_peers(group_ranks: GroupRanks) -> Callable[[int], int]:
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
