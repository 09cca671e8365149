"""The check of every switch, indexed by what the tensors themselves say (their DTensor placements and mesh, through
torch's offset arithmetic: `check.placement`), never by the plan the engine ran.

Every element of a new shard got there one of two ways, and each is checked against the tensors' own placements:

- **Over the wire.** Each process hashes every piece it sends with the global indices its live (old) tensor's own
  placements give those local elements, and every piece it receives with the indices its adopted (new) tensor's own
  placements give the local elements it was written to. Summed over the processes, what was sent equals what was
  received, state by state, only if every moved element landed at its own global index: a placement error that plan
  and engine share (a rank map or mesh coordinate mixed up, a strided shard converted wrongly, a probe mesh unlike the
  real one) moves an element to another index and names its state.
- **Copied locally** (or kept in place). The old tensor's own placements and the new one's must give the same global
  indices for the copied region; this is arithmetic on index ranges, no element is read.

And each new shard must be written whole and once (the regions received and copied tile it). The plan says which
regions the engine moved, and each of those claims is checked; no claim is taken as the index of an element.

The optimizer's scalars (``step``), its hyper-parameters and the LR schedulers' states are hashed whole before and
after (`state_sums.local_sums`). A world change that some member leaves reduces the sums of before on the old world
and hands them to joining processes; where every member stays, the one all-reduce of after sums both sides (a joining
process adding nothing to before). The check's seconds are the ``verify`` phase of the switch's report: it reads the moved bytes
once more on each side, not the whole state.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import add
from typing import Any, Protocol

import torch
from torch import nn

from dynatrain.check.hashing import PieceSums
from dynatrain.check.int64 import wrap64
from dynatrain.check.module_states import PARAM_GROUP, SCHEDULER, module_state_tensors
from dynatrain.check.placement import local_part, placed_indices
from dynatrain.check.replicas import kept_scalars
from dynatrain.check.state_sums import StateSums, explain, local_sums
from dynatrain.runtime import control_group


class CheckContext(Protocol):
    """What the check reads of a switch's context (a `dynatrain.switch.context.SwitchContext` has it): the module
    and optimizer the process trains on, and the current world's control group."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def control_group(self) -> Any: ...

    def optimizer(self) -> Any: ...


class SwitchVerificationError(RuntimeError):
    """The state after a switch differs from the state before it."""


@dataclass
class Before:
    """What one side of the check knows before anything moves: per routed state (``names``), the sum of the pieces sent
    (this process's, or after `reduce` every process's: ``reduced``); the scalars' sums; per local copy of this
    process, the global indices its source tensor's placements give (per dimension) and its source region in them."""

    names: tuple[str, ...]
    sent: list[int]
    scalars: StateSums
    copies: list = field(default_factory=list)
    reduced: bool = False


def _live(module: nn.Module, optimizer, schedulers: Sequence[dict]) -> tuple[dict, dict]:
    """(routed tensors by state name, scalars by name) of a module and its optimizer, as the capture names them."""
    tensors, scalars = module_state_tensors(module, optimizer, param_groups=False)
    if optimizer is not None:
        for i, group in enumerate(optimizer.param_groups):
            # Hyper-parameters only: which parameters a group holds differs between pipeline stages.
            scalars[f"{PARAM_GROUP}.{i}"] = {k: v for k, v in group.items() if k != "params"}
    for i, state in enumerate(schedulers):
        # As JSON, the form a joining process receives them in (tuples become lists).
        scalars[f"{SCHEDULER}.{i}"] = json.loads(json.dumps(state, default=repr))
    return tensors, scalars


def _indices(t: torch.Tensor) -> list:
    """Per dimension, the global indices of ``t``'s local elements (a 0-d tensor as the one element it is captured
    as)."""
    if t.dim() == 0:
        return [range(1)]
    indices = placed_indices(t)
    if indices is None:
        raise ValueError("holds no part of it on this process")
    return indices


class _Placed:
    """Per state, the global indices its live tensor's own placements give its local elements, found once a pass:
    a state's pieces and copies all read the same answer."""

    def __init__(self, tensors: dict) -> None:
        self.tensors, self._found = tensors, {}

    def indices(self, state: str) -> list:
        found = self._found.get(state)
        if found is None:  # KeyError, ValueError: not kept, raised again for each piece of the state
            found = self._found[state] = _indices(self.tensors[state])
        return found

    def local(self, state: str) -> tuple[torch.Tensor, list]:
        """(the local part, its global indices)."""
        return local_part(self.tensors[state]), self.indices(state)


class _Regions:
    """The box of a piece in its local tensor (`engine.wire.local_box`), this process's shards of each state looked
    up once."""

    def __init__(self, layout, me: int) -> None:
        self.layout, self.me, self._shards = layout, me, {}

    def __call__(self, state: str, shard: int, box) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shards = self._shards.get(state)
        if shards is None:
            shards = self._shards[state] = self.layout.shards(state, self.me)
        origin = shards.offsets[shard]
        return tuple(map(add, origin, box.lo)), tuple(map(add, origin, box.hi))


def _piece(local: torch.Tensor, indices: list, lo, hi) -> tuple[torch.Tensor, list]:
    """(the box ``lo:hi`` of ``local``, its global indices)."""
    view = local.reshape(1) if local.dim() == 0 else local
    return view[tuple(slice(a, b) for a, b in zip(lo, hi))], [ix[a:b] for ix, a, b in zip(indices, lo, hi)]


def _same(a, b) -> bool:
    if isinstance(a, range) and isinstance(b, range):
        return a == b
    return torch.equal(torch.as_tensor(list(a) if isinstance(a, range) else a),
                       torch.as_tensor(list(b) if isinstance(b, range) else b))


def _same_region(src: list, src_lo, src_hi, dst: list, dst_lo, dst_hi) -> bool:
    """Whether two regions of two tensors' local elements lie at the same global indices (``src`` and ``dst``: per
    dimension, the global indices of each tensor's local elements)."""
    return len(src) == len(dst) and all(_same(s[a:b], d[c:e]) for s, a, b, d, c, e in
                                        zip(src, src_lo, src_hi, dst, dst_lo, dst_hi))


@torch.no_grad()
def before(held, plan, me: int) -> Before:
    """This process's side before the switch: the pieces it sends, hashed by its live tensors' own placements."""
    kept = held.kept
    names = tuple(s.name for s in held.captured.specs)
    shapes = {s.name: tuple(s.shape) for s in held.captured.specs}
    tensors, scalars = _live(held.module, held.optimizer, kept.schedulers)
    out = Before(names, [0] * len(names), local_sums({}, scalars, sorted(kept_scalars(kept))))
    at = {n: i for i, n in enumerate(names)}
    rp, placed, region = plan.rank_plan(me), _Placed(tensors), _Regions(plan.old, me)
    sources = held.captured.sources
    with PieceSums(len(names)) as sent:  # read once at the end, not once per piece
        for messages in rp.sends:
            for message in messages:
                for t in message.pieces:
                    lo, hi = region(t.state, t.src_shard, t.src_box)
                    sent.add(at[t.state], *_piece(sources[t.state], placed.indices(t.state), lo, hi),
                             shapes[t.state])
    out.sent = sent.totals()
    for copies in rp.local_copies:
        for t in copies:
            out.copies.append((t, placed.indices(t.state), *region(t.state, t.src_shard, t.src_box)))
    return out


def _vector(ctx: CheckContext, values: list[int]) -> list[int]:
    return control_group.sum_ints([wrap64(v) for v in values], ctx.control_group)


def reduce(ctx: CheckContext, side: Before) -> Before:
    """``side`` summed over the processes of the current world (the copies stay this process's)."""
    n = len(side.names)
    total = _vector(ctx, side.sent + side.scalars.vector())
    return Before(side.names, total[:n], StateSums.from_vector(side.scalars.names, total[n:]), side.copies, True)


@torch.no_grad()
def after(ctx: CheckContext, old: Before, planned, schedulers: Sequence[dict]) -> bool:
    """Raise `SwitchVerificationError` naming every state that differs; ``old``: this process's side of before, or
    the totals over the old world (``old.reduced``), reduced here with the sums of after otherwise;
    ``schedulers``: the LR schedulers' states the process trains on with."""
    plan, me = planned.plan, planned.me
    names, at = old.names, {n: i for i, n in enumerate(old.names)}
    shapes = {s.name: tuple(s.shape) for s in plan.new.states}
    tensors, scalars = _live(ctx.module, ctx.optimizer(), schedulers)
    bad = [0] * len(names)
    problems: dict[str, str] = {}
    placed, region = _Placed(tensors), _Regions(plan.new, me)
    cover: dict[str, list] = {}

    def fault(state: str, why: str) -> None:
        bad[at[state]] += 1
        problems.setdefault(state, why)

    rp = plan.rank_plan(me)
    with PieceSums(len(names)) as got:  # read once at the end, not once per piece
        for messages in rp.recvs:
            for message in messages:
                for t in message.pieces:
                    lo, hi = region(t.state, t.dst_shard, t.dst_box)
                    cover.setdefault(t.state, []).append((lo, hi))
                    try:
                        got.add(at[t.state], *_piece(*placed.local(t.state), lo, hi), shapes[t.state])
                    except (KeyError, ValueError, IndexError) as e:
                        fault(t.state, f"a received piece has no place in the adopted tensor ({e})")
    received = got.totals()
    same: dict = {}  # a parameter's moments are placed and copied as it is: each answer is worked out once
    for t, src, src_lo, src_hi in old.copies:  # this process's own, also after a `reduce`
        lo, hi = region(t.state, t.dst_shard, t.dst_box)
        cover.setdefault(t.state, []).append((lo, hi))
        try:
            dst = placed.indices(t.state)
        except (KeyError, ValueError) as e:
            fault(t.state, f"a local copy has no place in the adopted tensor ({e})")
            continue
        key = id(src), id(dst), src_lo, src_hi, lo, hi  # both index lists live through the pass: ids stay theirs
        ok = same.get(key)
        if ok is None:
            ok = same[key] = _same_region(src, src_lo, src_hi, dst, lo, hi)
        if not ok:
            fault(t.state, "a region kept on this process lies at other global indices after the switch")
    for state, regions in _tiles(tensors, cover, names).items():
        fault(state, regions)
    new_scalars = local_sums({}, scalars, old.scalars.names)

    n = len(names)
    if old.reduced:
        total = _vector(ctx, received + bad + new_scalars.vector())
        sent, received, bad = old.sent, total[:n], total[n:2 * n]
        old_scalars, new_scalars = old.scalars, StateSums.from_vector(old.scalars.names, total[2 * n:])
    else:
        total = _vector(ctx, old.sent + received + bad + old.scalars.vector() + new_scalars.vector())
        sent, received, bad = total[:n], total[n:2 * n], total[2 * n:3 * n]
        k = len(old.scalars.vector())
        old_scalars = StateSums.from_vector(old.scalars.names, total[3 * n:3 * n + k])
        new_scalars = StateSums.from_vector(old.scalars.names, total[3 * n + k:])
    wrong = {}
    for i, name in enumerate(names):
        if bad[i]:
            wrong[name] = problems.get(name, f"{bad[i]} process(es) found its new shard misplaced")
        elif sent[i] != received[i]:
            wrong[name] = "values differ: what was received is not what was sent, at the same global indices"
    wrong.update(explain(old_scalars, new_scalars))
    if wrong:
        shown = "; ".join(f"{name}: {why}" for name, why in list(wrong.items())[:5])
        raise SwitchVerificationError(
            f"switch {planned.old_layout.config.short()} -> {planned.target.short()} changed {len(wrong)} "
            f"state(s): {shown}")
    return True


def _tiles(tensors: dict, cover: dict[str, list], names: Sequence[str]) -> dict[str, str]:
    """States whose new local shard on this process is not written whole and once by the regions received and
    copied into it."""
    out = {}
    for name in names:
        live = tensors.get(name)
        if live is None:
            continue
        numel = local_part(live).numel()  # a 0-d tensor is one element, as it is captured
        regions = cover.get(name, [])
        volume = 0
        for lo, hi in regions:
            n = 1
            for a, b in zip(lo, hi):
                n *= max(b - a, 0)
            volume += n
        if volume != numel or _overlap(regions):
            out[name] = (f"its new shard of {numel} elements on this process was written as {volume} elements in "
                         f"{len(regions)} region(s)" + (", some twice" if volume == numel else ""))
    return out


def _overlap(regions: list) -> bool:
    for i, (lo_a, hi_a) in enumerate(regions):
        for lo_b, hi_b in regions[i + 1:]:
            if all(max(a, b) < min(c, d) for a, b, c, d in zip(lo_a, lo_b, hi_a, hi_b)):
                return True
    return False


def to_json(side: Before) -> dict:
    """The sums of before for a joining process (which has no local copies): reduced over the old world, or, where
    every member stays and `after` reduces both sides in its one all-reduce, none (the joiner adds nothing)."""
    if not side.reduced:
        side = Before(side.names, [0] * len(side.names), StateSums.empty(side.scalars.names))
    return {"names": list(side.names), "sent": side.sent, "scalar_names": list(side.scalars.names),
            "scalars": side.scalars.vector(), "reduced": side.reduced}


def from_json(row: dict) -> Before:
    return Before(tuple(row["names"]), list(row["sent"]),
                  StateSums.from_vector(tuple(row["scalar_names"]), row["scalars"]), reduced=row["reduced"])
