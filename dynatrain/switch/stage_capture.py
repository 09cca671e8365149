"""The states of every pipeline stage, as every process must plan with them.

Under pp a process holds only its stage's parameters, optimizer tensors and scalars, but a switch plans over all
of them, identically on every rank. One all-gather of what each process captured (names, shapes, placements,
the optimizer's kept scalars and entry order; no tensor data) gives every rank the same table, in stage order.
"""

from __future__ import annotations

import torch

from dynatrain.runtime import control_group
from dynatrain.switch.capture import Captured


def _cpu(entries: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in entries.items()}


def merge_stages(local: Captured, order: dict[str, list[str]], group=None) -> Captured:
    """Every stage's specs, shardings (a state several stages hold is held by all of them), owners, scalars and
    optimizer entry order; this process's sources. Every rank of ``group`` calls it."""
    row = (local.specs, local.shardings, local.param_of, {p: _cpu(e) for p, e in local.scalars.items()}, order)
    rows = control_group.all_gather_object(row, group)
    specs, shardings, index = [], [], {}
    param_of, scalars, orders = {}, {}, {}
    for r_specs, r_shardings, r_param_of, r_scalars, r_order in rows:
        for spec, sh in zip(r_specs, r_shardings):
            i = index.get(spec.name)
            if i is None:
                index[spec.name] = len(specs)
                specs.append(spec)
                shardings.append(sh)
            elif specs[i] != spec:
                raise ValueError(f"state {spec.name!r} is {specs[i]} on one pipeline stage and {spec} on another")
            else:
                shardings[i] = shardings[i].union(sh)
        param_of.update(r_param_of)
        for p, entries in r_scalars.items():
            scalars.setdefault(p, entries)
        for p, keys in r_order.items():
            orders.setdefault(p, keys)
    for p, entries in local.scalars.items():
        scalars[p] = entries  # this process's own, on its device
    return Captured(tuple(specs), tuple(shardings), param_of, local.sources, scalars, orders)
