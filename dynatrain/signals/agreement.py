"""Agreeing on one request across ranks: every rank's pending request in a fixed-size slot, all slots all-gathered.

Each rank hears its own signals, so ranks hold different requests at a step boundary. All ranks merge the same
gathered slots with :func:`merge_proposals` and reach the same decision without a second round:

* the ranks that announced they leave are united;
* the latest target (``devices`` or ``layout``, with its ``wait``) wins, by wall-clock time of receipt, then
  lower rank.

Unlike the sources, this module imports torch: the slots travel as a uint8 tensor.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from dynatrain.runtime import control_group
from dynatrain.signals.request import ScaleRequest, describe_request

SLOT_BYTES = 4096
MAX_REASON = 512


@dataclass(frozen=True)
class Proposal:
    """One rank's pending request as every rank receives it.

    ``wall_time`` replaces the request's monotonic ``received_at`` (meaningless in another process);
    ``deadline_in`` is the seconds left, at sending, before a preempted rank dies.
    """

    rank: int
    devices: int | None = None
    layout: str | None = None
    leave: tuple[int, ...] = ()
    source: str = "control"
    reason: str = ""
    wall_time: float = 0.0
    deadline_in: float | None = None
    wait: bool = False

    @classmethod
    def from_request(cls, rank: int, request: ScaleRequest, now_wall: float | None = None,
                     now_mono: float | None = None) -> "Proposal":
        now_wall = time.time() if now_wall is None else now_wall
        now_mono = time.monotonic() if now_mono is None else now_mono
        deadline_in = None if request.deadline is None else request.deadline - now_mono
        return cls(rank, request.devices, request.layout, request.leave, request.source,
                   request.reason[:MAX_REASON], now_wall - (now_mono - request.received_at), deadline_in,
                   request.wait)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Proposal":
        return cls(**{**d, "leave": tuple(d.get("leave") or ())})


@dataclass(frozen=True)
class Slot:
    """What one rank contributes at a boundary: its request, if any, and whether it runs the listening sources
    (control server, watched file), so the ranks notice when the process that ran them has left."""

    proposal: Proposal | None = None
    listening: bool = False


def encode_slot(slot: Slot, size: int = SLOT_BYTES) -> torch.Tensor:
    """A ``size``-byte uint8 tensor: 4 bytes of length, then the slot as JSON."""
    body = {"proposal": None if slot.proposal is None else asdict(slot.proposal), "listening": slot.listening}
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) + 4 > size:
        raise ValueError(f"a scale request of {len(data)} bytes does not fit the {size}-byte agreement slot")
    out = torch.zeros(size, dtype=torch.uint8)
    out[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    out[4:4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def decode_slot(tensor: torch.Tensor) -> Slot:
    raw = bytes(tensor.tolist())
    body = json.loads(raw[4:4 + int.from_bytes(raw[:4], "little")].decode())
    proposal = body["proposal"]
    return Slot(None if proposal is None else Proposal.from_dict(proposal), bool(body["listening"]))


@dataclass(frozen=True)
class MergedRequest:
    """What all ranks agreed was asked: one target (or none: a bare preemption) and every leaving rank."""

    devices: int | None
    layout: str | None
    leave: tuple[int, ...]
    source: str                  # the source of the winning target ("preemption" when only ranks leave)
    reason: str
    origin_rank: int
    wall_time: float             # when the winning request was received (earliest preemption when no target)
    sources: tuple[str, ...]     # every source that contributed, in rank order
    deadline_in: float | None = None
    wait: bool = False           # the winning target's: hold training until a scale-out's joiners are ready

    def describe(self) -> str:
        return describe_request(self.devices, self.layout, self.leave, self.wait)


def merge_proposals(proposals: Sequence[Proposal | None]) -> MergedRequest | None:
    """The one request every rank acts on; the same on every rank whatever the order of ``proposals``."""
    got = sorted((p for p in proposals if p is not None), key=lambda p: p.rank)
    if not got:
        return None
    leave = tuple(sorted({r for p in got for r in p.leave}))
    deadlines = [p.deadline_in for p in got if p.deadline_in is not None]
    targeted = [p for p in got if p.devices is not None or p.layout is not None]
    # Latest wins; equal times (the same trace entry on every rank) go to the lowest rank.
    win = max(targeted, key=lambda p: (p.wall_time, -p.rank)) if targeted else \
        min(got, key=lambda p: (p.wall_time, p.rank))
    sources = tuple(dict.fromkeys(p.source for p in got))
    return MergedRequest(
        devices=win.devices if targeted else None, layout=win.layout if targeted else None, leave=leave,
        source=win.source, reason=win.reason, origin_rank=win.rank, wall_time=win.wall_time, sources=sources,
        deadline_in=min(deadlines) if deadlines else None, wait=win.wait if targeted else False,
    )


def all_gather_slots(slot: Slot, group=None) -> list[Slot]:
    """Every rank's slot, in rank order of ``group`` (the world's control group, `dynatrain.runtime.control_group`);
    only ``slot`` without a process group."""
    if not control_group.distributed():
        return [slot]
    gathered = control_group.all_gather_bytes(encode_slot(slot), group)
    return [decode_slot(gathered[i * SLOT_BYTES:(i + 1) * SLOT_BYTES]) for i in range(len(gathered) // SLOT_BYTES)]
