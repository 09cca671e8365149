"""The independent oracle of a switch: the pre-switch state saved with DCP and loaded into the target layout.

DCP reshards through its own planner (saved chunks x wanted chunks) and storage, sharing no code with the
switch engine, so agreement between the two is a real check.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_state_dict,
    set_state_dict,
)

from dynatrain.switch.capture import local_tensor
from dynatrain.switch.target import param_children


# Hyper-parameters stored per parameter name: under pp each stage holds other parameters, and a list of param
# groups saved once (by rank 0) would name only the first stage's.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def save(module: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    msd, osd = get_state_dict(module, optimizer, options=_OPTIONS)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    # DCP holds the persistent buffers; the others each rank saves as it has them, beside the checkpoint.
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save({n: b.detach().cpu().clone() for n, b in _non_persistent_buffers(module)},
               Path(path) / f"buffers-{rank}.pt")


def _non_persistent_buffers(module: torch.nn.Module):
    for prefix, owner in module.named_modules():
        for key in owner._non_persistent_buffers_set:
            b = owner._buffers.get(key)
            if b is not None:
                yield (f"{prefix}.{key}" if prefix else key), b


def restore_buffers(module: torch.nn.Module, path: Path) -> None:
    """The non-persistent buffers saved beside the checkpoint at ``path``, into ``module``."""
    saved = _saved_buffers(path)
    with torch.no_grad():
        for name, b in _non_persistent_buffers(module):
            if name in saved and not b.is_meta:
                b.copy_(saved[name])


def _saved_buffers(path: Path) -> dict[str, torch.Tensor]:
    """The non-persistent buffers of every rank that saved the checkpoint (a pipeline stage holds its own)."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("buffers-*.pt")):
        for name, value in torch.load(file, weights_only=True).items():
            out.setdefault(name, value)
    return out


def load_into_layout(strategy, module, path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh copy of the LightningModule and optimizer on the strategy's current (new) mesh, built by the
    module's own parallelisation and filled from the checkpoint at path: by DCP, and the buffers DCP does not hold
    (non-persistent ones) from what the ranks saved beside it, never from the live module it is compared with."""
    fresh = strategy.build_target(strategy.device_mesh, strategy.parallel_config)
    for name in param_children(fresh):
        fresh._modules[name].to_empty(device=strategy.root_device)
    restore_buffers(fresh, path)
    live = strategy.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    params = dict(fresh.named_parameters())
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[names[id(p)]] for p in g["params"]]}
              for g in live.param_groups]
    optimizer = type(live)(groups)
    _init_optim_state(optimizer)
    msd, osd = get_state_dict(fresh, optimizer, options=_OPTIONS)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(fresh, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_OPTIONS)
    return fresh, optimizer


def bitwise_equal(model_a, opt_a, model_b, opt_b, device, buffers: bool = True) -> bool:
    """True on every rank when every local weight and optimizer tensor (and buffer, with ``buffers``) of a equals
    b's bit for bit."""
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
    buffers_b = dict(model_b.named_buffers()) if buffers else {}
    for name, ba in model_a.named_buffers() if buffers else ():
        bb = buffers_b.get(name)
        if bb is not None and not bb.is_meta:  # a module without parameters is not part of the copy
            ok &= torch.equal(ba.cpu(), bb.cpu())
    flag = torch.tensor(1 if ok else 0, device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
