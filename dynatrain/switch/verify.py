"""The check of every switch: the same states before and after, bit for bit, indexed by what the tensors themselves
say (their DTensor placements and mesh, through torch's offset arithmetic: `engine.placed_sums`), never by the plan
the engine ran. A placement error that plan and engine share (a rank map or mesh coordinate mixed up, a strided
shard converted wrongly, a probe mesh that differs from the real one) moves an element to another global index and
changes its state's sum.

It covers every parameter, buffer and optimizer tensor, the optimizer's scalars (``step``) and hyper-parameters, and
the LR schedulers' states. Before the switch each process sums what its live tensors hold; after it, what its
adopted ones hold; one all-reduce compares both (a world change reduces the sums of before on the old world, and a
joining process receives them with its payload). Its seconds are the ``verify`` phase of the switch's report.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from torch import nn

from dynatrain.engine import placed_sums
from dynatrain.engine.placed_sums import StateSums
from dynatrain.switch.context import SwitchContext

class SwitchVerificationError(RuntimeError):
    """The state after a switch differs from the state before it."""


GROUP = "#param_group"
SCHEDULER = "#scheduler"


def _states(module: nn.Module, optimizer, schedulers: Sequence[dict]) -> tuple[dict, dict]:
    tensors, scalars = placed_sums.module_state_tensors(module, optimizer, param_groups=False)
    if optimizer is not None:
        for i, group in enumerate(optimizer.param_groups):
            # Hyper-parameters only: which parameters a group holds differs between pipeline stages.
            scalars[f"{GROUP}.{i}"] = {k: v for k, v in group.items() if k != "params"}
    for i, state in enumerate(schedulers):
        # As JSON, the form a joining process receives them in (tuples become lists).
        scalars[f"{SCHEDULER}.{i}"] = json.loads(json.dumps(state, default=repr))
    return tensors, scalars


def before(ctx: SwitchContext, held) -> StateSums:
    """This process's sums of the live states, over the states every process agreed on (every pipeline stage's)."""
    kept = held.kept
    names = {s.name for s in held.captured.specs}
    names |= {f"{p}.{k}" for p, entries in kept.scalars.items() for k in entries}
    names |= {f"{GROUP}.{i}" for i in range(len(kept.groups))}
    names |= {f"{SCHEDULER}.{i}" for i in range(len(kept.schedulers))}
    return _sums(held.module, held.optimizer, kept.schedulers, sorted(names))


def _sums(module: nn.Module, optimizer, schedulers: Sequence[dict], names: Sequence[str]) -> StateSums:
    tensors, scalars = _states(module, optimizer, schedulers)
    return placed_sums.local_sums(tensors, scalars, names)


def reduce(ctx: SwitchContext, sums: StateSums) -> StateSums:
    return placed_sums.reduce(sums, ctx.device)


def after(ctx: SwitchContext, old: StateSums, planned, reduced: bool, schedulers: Sequence[dict]) -> bool:
    """Raise `SwitchVerificationError` naming every state that differs; ``reduced``: ``old`` holds the totals over
    the old world already; ``schedulers``: the LR schedulers' states the process trains on with."""
    new = _sums(ctx.module, ctx.optimizer(), schedulers, old.names)
    if reduced:
        bad = placed_sums.explain(old, placed_sums.reduce(new, ctx.device))
    else:
        bad = placed_sums.compare(old, new, ctx.device)
    if bad:
        shown = "; ".join(f"{name}: {why}" for name, why in list(bad.items())[:5])
        raise SwitchVerificationError(
            f"switch {planned.old_layout.config.short()} -> {planned.target.short()} changed {len(bad)} state(s): "
            f"{shown}")
    return True


def to_json(sums: StateSums) -> dict:
    """Reduced sums, for a joining process (the per-rank ``problems`` stay behind)."""
    return {"names": list(sums.names), "vector": sums.vector()}


def from_json(row: dict) -> StateSums:
    return StateSums.from_vector(tuple(row["names"]), row["vector"])
