"""What a lost process means for a switch: how its loss shows up, which layout the survivors take, and the errors
that stop a process instead of training on partial state.

What cannot be rebuilt in memory (a shard with no replica, survivors that disagree on the step, a fault inside a
switch, whose engine frees shards as it sends them) stops the job with `WorldChangeError` naming why; the job then
resumes from its latest committed snapshot.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from dynatrain.switch.context import SwitchContext
from dynatrain.vps.parallel_config import ParallelConfig

# What gloo and NCCL say when a peer of a collective died or stopped answering.
_PEER_LOSS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "timeout",
    "nccl communicator", "remote process exited", "socket",
)


def is_peer_loss(error: BaseException) -> bool:
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error).lower() for s in _PEER_LOSS)


class WorldChangeError(RuntimeError):
    """A world change or a recovery could not complete; the process must not go on training."""


class RecoveryStop(ValueError):
    """The survivors cannot rebuild the state in memory (the reason is the message)."""


def reshard(model: nn.Module) -> None:
    """A fault mid-forward or mid-backward leaves FSDP's unsharded parameters registered on some modules;
    put the sharded ones (which the optimizer holds, unchanged since the last step) back. Local, no collective."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def survivors_target(ctx: SwitchContext, count: int) -> ParallelConfig:
    """The layout for ``count`` survivors: the old one when nobody was lost (a transient fault), else the one the
    job's policy chooses, else the old TP degree when it still divides, else pure FSDP; always one the model and
    the global batch accept."""
    old = ctx.layout
    candidates: list[ParallelConfig] = [old] if count == old.world_size else []
    try:
        chosen = ctx.choose_layout(count)
    except ValueError:
        chosen = None
    if chosen is not None:
        candidates.append(chosen)
    candidates.extend(old.survivor_layouts(count))
    errors = []
    for c in candidates:
        try:
            return ctx.check_layout(c, count)
        except ValueError as e:
            errors.append(str(e))
    raise ValueError(f"no layout fits the {count} surviving processes: " + "; ".join(errors))
