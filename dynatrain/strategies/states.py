"""A switch's states on this rank: captured from the live module and optimizer (and agreed across ranks), what
survives besides the routed shards, and the release of the old shards to the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dynatrain.strategies.capture import Captured, capture, check_switchable
from dynatrain.strategies.stage_capture import merge_stages
from dynatrain.strategies.target import release_children

if TYPE_CHECKING:
    from dynatrain.strategies.switcher import Switcher


def capture_states(switcher: "Switcher", module, optimizer) -> Captured:
    """This rank's states; under pp with every stage's specs and kept entries beside them (`merge_stages`)."""
    strategy = switcher.strategy
    captured = capture(module, optimizer, strategy.device_mesh)
    if strategy.parallel_config is None or strategy.parallel_config.pp == 1:
        return captured
    return merge_stages(captured, entry_order(switcher, optimizer))


def capture_agreed(switcher: "Switcher"):
    """(module, optimizer, captured states) of this rank, checked switchable and equal on every rank: one
    all-reduce of the specs' fingerprint before anything moves."""
    strategy = switcher.strategy
    module, optimizer = strategy.lightning_module, switcher.optimizer()
    check_switchable(module, strategy.optimizers)
    captured = capture_states(switcher, module, optimizer)
    if strategy.world_size > 1:
        _agree_on(strategy, captured)
    return module, optimizer, captured


def _agree_on(strategy, captured: Captured) -> None:
    mark = captured.fingerprint()
    t = torch.tensor([mark, -mark], dtype=torch.int64, device=strategy.root_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(t[0]) != mark or int(t[1]) != -mark:
        raise ValueError("the ranks hold different sets of states (names, shapes, dtypes or placements): a "
                         "module or optimizer that differs between ranks cannot be switched")


def entry_order(switcher: "Switcher", optimizer) -> dict[str, list[str]]:
    """Per parameter name, its optimizer entries' keys in the order the optimizer created them."""
    names = {id(p): n for n, p in switcher.strategy.lightning_module.named_parameters()}
    return {names[id(p)]: list(st) for p, st in optimizer.state.items()} if optimizer is not None else {}


def keep_states(switcher: "Switcher", captured: Captured, optimizer) -> dict:
    """What survives a switch besides the routed shards: scalars, hyper-parameters, schedules."""
    return {
        "param_of": captured.param_of, "scalars": captured.scalars,
        "order": captured.order if captured.order is not None else entry_order(switcher, optimizer),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        if optimizer else [],
        "schedulers": [cfg.scheduler.state_dict() for cfg in switcher.strategy.lr_scheduler_configs],
    }


def release_module(switcher: "Switcher", module, optimizer) -> list[str]:
    """Drop every reference to the old shards but the engine's, so it can free each after its last send."""
    if optimizer is not None:
        optimizer.state.clear()
        for g in optimizer.param_groups:
            g["params"] = []
    switcher.strategy.optimizers = []
    switcher.released = True
    return release_children(module)
