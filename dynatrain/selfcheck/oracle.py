"""The independent oracle of a switch: the pre-switch state saved with DCP and loaded into the target layout.

DCP reshards through its own planner (saved chunks x wanted chunks) and storage, sharing no code with the
switch engine, so agreement between the two is a real check.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import _init_optim_state, get_state_dict, set_state_dict

from dynatrain.models.parallelize import allocate_model
from dynatrain.strategies.capture import local_tensor


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def load_into_layout(strategy, module, path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh model and optimizer on the strategy's current (new) mesh, filled from the checkpoint at path."""
    model = strategy.build_target(strategy.device_mesh, strategy.parallel_config).model
    allocate_model(model, strategy.root_device)
    live = strategy.optimizers[0]
    groups = []
    names = {id(p): n for n, p in module.model.named_parameters()}
    params = dict(model.named_parameters())
    for g in live.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [params[names[id(p)]] for p in g["params"]]})
    optimizer = type(live)(groups)
    _init_optim_state(optimizer)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, optimizer


def bitwise_equal(model_a, opt_a, model_b, opt_b, device) -> bool:
    """True on every rank when every local weight, Adam moment and step of a equals b's bit for bit."""
    ok = True
    params_b = dict(model_b.named_parameters())
    for name, pa in model_a.named_parameters():
        pb = params_b[name]
        ok &= torch.equal(local_tensor(pa.detach()), local_tensor(pb.detach()))
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        if set(sa) != set(sb):
            ok = False
            continue
        for key in sa:
            ok &= torch.equal(local_tensor(sa[key]).cpu(), local_tensor(sb[key]).cpu())
    flag = torch.tensor(1 if ok else 0, device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
