"""What a layout switch does to Lightning-held training state: gather the old shards, adopt the new ones.

The bytes move in `engine.transition`; this module only maps between the model / optimizer objects and the
layout's named states (``<param>``, ``<param>.exp_avg``, ``<param>.exp_avg_sq``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch.distributed.tensor import DTensor

from dynatrain.models.specs import rule_for_param
from dynatrain.vps.layout import StateSpec

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class SwitchReport:
    """One layout switch, as every rank saw it (bytes and peak are this rank's unless named total)."""

    step: int
    old_layout: str
    new_layout: str
    world_size: int  # processes in the new world (0 on a process that left)
    bytes_total: int
    bytes_moved: int
    bytes_moved_identity: int | None
    rounds: int
    rank_map: list[int]
    peak_bytes: int
    peak_bound: int
    verified: bool | None
    phases: dict[str, float] = field(default_factory=dict)
    old_world_size: int | None = None
    prepared: bool = False  # a world change planned in the background while training went on

    @property
    def stall_s(self) -> float:
        return sum(self.phases.values())

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stall_s"] = self.stall_s
        return d


class PhaseTimer:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._t
        self._t = now


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def state_specs(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[StateSpec, ...]:
    """The routed states of ``model`` and its Adam moments, in parameter order, with their real dtypes."""
    specs = []
    with_moments = optimizer is not None and any(optimizer.state.get(p) for p in model.parameters())
    for name, p in model.named_parameters():
        rule = rule_for_param(name, tuple(p.shape))
        specs.append(StateSpec(name, tuple(p.shape), _dtype_name(p), rule.tp_dim, rule.fused))
        if with_moments:
            state = optimizer.state.get(p)
            if not state:
                raise RuntimeError(f"parameter {name!r} has no optimizer state while others do")
            for moment in ADAM_MOMENTS:
                specs.append(StateSpec(f"{name}.{moment}", tuple(p.shape), _dtype_name(state[moment]), rule.tp_dim,
                                       rule.fused))
    return tuple(specs)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def collect_sources(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """Every routed state's local tensor on this rank, keyed by state name."""
    src: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        src[name] = local_tensor(p.detach())
        state = optimizer.state.get(p) if optimizer is not None else None
        if state:
            for moment in ADAM_MOMENTS:
                src[f"{name}.{moment}"] = local_tensor(state[moment])
    return src


def scalar_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, dict]:
    """Per parameter name, the optimizer's scalar entries (Adam's ``step``): equal on every rank, never routed."""
    out: dict[str, dict] = {}
    if optimizer is None:
        return out
    for name, p in model.named_parameters():
        entries = {k: v.clone() if isinstance(v, torch.Tensor) else v
                   for k, v in (optimizer.state.get(p) or {}).items() if k not in ADAM_MOMENTS}
        if entries:
            out[name] = entries
    return out


def adopt_weights(model: torch.nn.Module, dst: dict[str, torch.Tensor]) -> None:
    """Copy the engine's new local weights into a materialised model, freeing each as soon as it is copied."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = local_tensor(p)
            new = dst.pop(name)
            if new.shape != local.shape:
                raise RuntimeError(f"{name}: engine produced {tuple(new.shape)}, the model holds {tuple(local.shape)}")
            local.copy_(new)
            del new


def install_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, dst: dict[str, torch.Tensor],
    scalars: Mapping[str, dict],
) -> None:
    """Give each new parameter its moved Adam moments (as DTensors shaped like the parameter) and its step."""
    for name, p in model.named_parameters():
        if f"{name}.{ADAM_MOMENTS[0]}" not in dst:
            continue
        state = {}
        for moment in ADAM_MOMENTS:
            local = dst.pop(f"{name}.{moment}")
            if isinstance(p, DTensor):
                state[moment] = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                                   shape=p.shape, stride=p.stride())
            else:
                state[moment] = local
        state.update(scalars.get(name, {}))
        optimizer.state[p] = state
