"""How one round's messages go on the wire: which pieces travel straight from the source tensor or straight into
the destination tensor, and which are packed into the staging buffer.

A piece whose box is one contiguous run of its local tensor needs no copy on that side: the send reads the view
and the receive writes it. Both sides must post the same operations with the same sizes in the same order, so
the split is decided from the plan alone (the box and the local shape of *both* ends are known to both): a piece
of at least ``DIRECT_MIN_BYTES`` that is contiguous on either side is its own operation, staged only on the side
where it is strided; every other piece of the message shares one packed operation. Small pieces stay
packed because one operation per small piece costs more in posting than the copy it saves.

Here too: where each staged operation sits in the staging buffer (`slots`), and a piece's box as a view of its local
tensor (`box_view`), which is what goes on the wire in place (`in_place`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dynatrain.engine.checks import TransitionError
from dynatrain.planner.routing import Transfer
from dynatrain.planner.schedule import Message
from dynatrain.vps.box import Box
from dynatrain.vps.layout import Layout

DIRECT_MIN_BYTES = 64 * 1024
ALIGN = 16  # bytes: every message slot of the staging buffer starts at a multiple of this


@dataclass(frozen=True)
class WireOp:
    """One send or receive: ``pieces`` in order, ``nbytes`` in all. ``src_direct``: the sender posts the source
    view itself; ``dst_direct``: the receiver posts the destination view itself (both only for one piece)."""

    peer: int
    pieces: tuple[Transfer, ...]
    nbytes: int
    src_direct: bool
    dst_direct: bool


def contiguous(local_shape: tuple[int, ...], origin: tuple[int, ...], box: Box) -> bool:
    """Whether ``box`` (in the coordinates of a shard at ``origin``) is one run of a C-ordered tensor of
    ``local_shape``: after the first dimension it spans more than one index of, every dimension is whole."""
    spanning = False
    for n, o, lo, hi in zip(local_shape, origin, box.lo, box.hi):
        if spanning and (o + lo != 0 or o + hi != n):
            return False
        if hi - lo > 1:
            spanning = True
    return True


def _piece_sides(t: Transfer, old: Layout, new: Layout) -> tuple[bool, bool]:
    s_sh, d_sh = old.shards(t.state, t.src), new.shards(t.state, t.dst)
    return (contiguous(tuple(s_sh.local_shape), s_sh.offsets[t.src_shard], t.src_box),
            contiguous(tuple(d_sh.local_shape), d_sh.offsets[t.dst_shard], t.dst_box))


def split_message(m: Message, old: Layout, new: Layout, peer: int) -> list[WireOp]:
    """The operations of one message, identical on the sending and the receiving process."""
    ops, packed = [], []
    for t in m.pieces:
        src_direct, dst_direct = _piece_sides(t, old, new) if t.nbytes >= DIRECT_MIN_BYTES else (False, False)
        if src_direct or dst_direct:
            ops.append(WireOp(peer, (t,), t.nbytes, src_direct, dst_direct))
        else:
            packed.append(t)
    if packed:
        ops.append(WireOp(peer, tuple(packed), sum(t.nbytes for t in packed), False, False))
    return ops


def slots(ops: list[WireOp], start: int, staged: Callable[[WireOp], bool]) -> tuple[list[int], int]:
    """Each operation's offset in the staging buffer from ``start`` (a slot only for a staged one), and the end."""
    offs, pos = [], start
    for op in ops:
        offs.append(pos)
        if staged(op):
            pos += -(-op.nbytes // ALIGN) * ALIGN
    return offs, pos


def round_slots(sends: list[WireOp], recvs: list[WireOp]) -> tuple[list[int], list[int], int]:
    """Where a round's staged operations sit in the staging buffer, its sends' slots first and its receives' after
    them: (the sends' offsets, the receives' offsets, the bytes the round stages in all)."""
    send_offs, end = slots(sends, 0, send_staged)
    recv_offs, end = slots(recvs, end, recv_staged)
    return send_offs, recv_offs, end


def send_staged(op: WireOp) -> bool:
    return not op.src_direct


def recv_staged(op: WireOp) -> bool:
    return not op.dst_direct


def in_place(rank: int, view: torch.Tensor) -> torch.Tensor:
    if not view.is_contiguous():  # the plan's geometry and torch's disagree: never send the wrong bytes
        raise TransitionError(f"rank {rank}: a piece planned as contiguous is a strided view {view.stride()}")
    return view.reshape(-1).view(torch.uint8)


def box_view(t: torch.Tensor, origin: tuple[int, ...], box: Box) -> torch.Tensor:
    """``box`` (in the coordinates of the shard at ``origin`` inside local tensor ``t``) as a view of t."""
    return t[tuple(slice(o + l, o + h) for o, l, h in zip(origin, box.lo, box.hi))]


def local_box(origin: tuple[int, ...], box: Box) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(o + l for o, l in zip(origin, box.lo)), tuple(o + h for o, h in zip(origin, box.hi))
