"""A live module and its optimizer as routed states: names, shapes, dtypes and the placements DTensor records.

Every parameter is a state under its fully qualified name; every optimizer tensor of its parameter's shape is a
state ``<param>.<key>`` split like the parameter (AdamW's moments, amsgrad's ``max_exp_avg_sq``, SGD's
``momentum_buffer``, RMSprop's ``square_avg``, Adagrad's ``sum``); 0-d entries and plain numbers (``step``) are
equal on every rank and kept, not routed. Buffers are whole on every rank (FSDP2 and TP never split them) and are
routed whole. Whatever else an optimizer keeps (a factored second moment, say) has no box in the parameter's
space: `check_switchable` refuses it when the switch is requested, before anything moves.

Buffers are states too, whole on every position (FSDP2 and TP never split them; a 0-d buffer travels as one
element): a process keeps its own values through a switch and a joining process receives a member's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from dynatrain.vps.layout import DTYPE_ITEMSIZE, StateSpec
from dynatrain.vps.placement import Replicate, Shard, Sharding, StridedShard


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _placement(p) -> Replicate | Shard | StridedShard:
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):  # a subclass of Shard: test it first
        return StridedShard(p.dim, p.split_factor)
    if isinstance(p, TorchShard):
        return Shard(p.dim)
    if isinstance(p, TorchReplicate):
        return Replicate()
    raise ValueError(f"placement {p} (a pending reduction) cannot be switched: switch at an optimizer-step boundary")


def _mesh_runs(mesh: DeviceMesh, root: DeviceMesh) -> list[tuple[int, ...] | None]:
    """For each dimension of ``mesh`` (a sub-mesh or flattening of ``root``), the run of root dimensions it spans
    (None for a dimension of size 1, which splits nothing)."""
    root_ranks = root.mesh.cpu().numpy()
    where = {int(r): np.unravel_index(i, root_ranks.shape) for i, r in enumerate(root_ranks.reshape(-1))}
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("a state lies on a mesh this process is not part of")
    ranks = mesh.mesh.cpu().numpy()
    out: list[tuple[int, ...] | None] = []
    for k in range(ranks.ndim):
        index = list(coord)
        index[k] = slice(None)
        line = [int(r) for r in ranks[tuple(index)]]
        if len(line) == 1:
            out.append(None)
            continue
        coords = np.array([where[r] for r in line])
        varying = [d for d in range(coords.shape[1]) if len(set(coords[:, d])) > 1]
        run = tuple(range(varying[0], varying[-1] + 1))
        sizes = [root_ranks.shape[d] for d in run]
        expected = np.array(list(np.ndindex(*sizes)))
        # A root dimension of size 1 inside the run (ep and cp's dp_shard_in_ep) is a flattening's too.
        gaps = [d for d in run if d not in varying and root_ranks.shape[d] != 1]
        if gaps or not np.array_equal(coords[:, list(run)], expected):
            raise ValueError(
                f"mesh dimension {k} of {mesh} runs over the root mesh's ranks {line} out of row-major order: only "
                "sub-meshes and flattenings of the strategy's device mesh can be switched"
            )
        out.append(run)
    return out


def _stage_coordinate(root: DeviceMesh) -> tuple[int, int] | None:
    """(root dimension, this process's coordinate) of the pipeline stages, or None without pp."""
    names = tuple(getattr(root, "mesh_dim_names", None) or ())
    if "pp" not in names or root.mesh.shape[names.index("pp")] == 1:
        return None
    dim = names.index("pp")
    return dim, root.get_coordinate()[dim]


def sharding_of(t: torch.Tensor, root: DeviceMesh, memo: dict | None = None) -> Sharding:
    """How ``t`` lies on the root mesh: its DTensor placements, or whole everywhere for a plain tensor; with pp,
    held by this process's stage only, unless its mesh spans the stages. ``memo``: a dict kept for one pass over
    a module (its meshes stay alive meanwhile), where tensors placed alike share one answer."""
    if memo is None:
        return _sharding_of(t, root)
    key = (id(t.device_mesh), tuple(t.placements)) if isinstance(t, DTensor) else None
    if key not in memo:
        memo[key] = _sharding_of(t, root)
    return memo[key]


def _sharding_of(t: torch.Tensor, root: DeviceMesh) -> Sharding:
    shape = tuple(root.mesh.shape)
    mesh_runs = _mesh_runs(t.device_mesh, root) if isinstance(t, DTensor) else []
    placements, runs = [], []
    for p, run in zip(t.placements if mesh_runs else (), mesh_runs):
        q = _placement(p)
        if run is not None and not isinstance(q, Replicate):
            placements.append(q)
            runs.append(run)
    sh = Sharding(shape, tuple(placements), tuple(runs))
    stage = _stage_coordinate(root)
    if stage is None or any(run is not None and stage[0] in run for run in mesh_runs):
        return sh
    return sh.held_along(stage[0], (stage[1],))


BUFFER = "#buffer"  # the key a buffer has in `Captured.param_of`


@dataclass
class Captured:
    """The routed states of a module and optimizer, with what is kept beside them."""

    specs: tuple[StateSpec, ...]
    shardings: tuple[Sharding, ...]
    param_of: dict[str, tuple[str, str | None]]  # state -> (owner, optimizer key; None: the weight; BUFFER)
    sources: dict[str, torch.Tensor]  # this rank's local tensors
    scalars: dict[str, dict]  # parameter -> optimizer entries that are not routed
    order: dict[str, list[str]] | None = None  # parameter -> its optimizer entries' keys, every stage's (pp)

    def fingerprint(self) -> int:
        """A number equal on every rank when every rank captured the same specs (all-reduced before planning)."""
        text = repr([(s.name, s.shape, s.dtype, str(sh)) for s, sh in zip(self.specs, self.shardings)])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _routed_entry(p: torch.Tensor, v) -> bool:
    """An optimizer entry split like its parameter; False for a kept scalar; ValueError for anything else."""
    if v is None or isinstance(v, (bool, int, float)):
        return False
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"an entry of type {type(v).__name__}")
    if v.dim() == 0:
        return False
    if tuple(v.shape) != tuple(p.shape) or isinstance(v, DTensor) != isinstance(p, DTensor):
        raise ValueError(f"a tensor of shape {tuple(v.shape)} beside a parameter of shape {tuple(p.shape)}")
    if isinstance(v, DTensor) and tuple(v.placements) != tuple(p.placements):
        raise ValueError(f"a tensor placed {v.placements} beside a parameter placed {p.placements}")
    if dtype_name(v) not in DTYPE_ITEMSIZE:
        raise ValueError(f"a tensor of dtype {v.dtype}")
    return True


def check_switchable(module: nn.Module, optimizers) -> None:
    """Raise ValueError saying what to change when a switch could not carry this module and optimizer over."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        raise ValueError("fully_shard was applied to the LightningModule itself: apply it to the modules it holds "
                         "(e.g. `fully_shard(self.model, mesh=...)`), so a switch can replace them")
    # A tied tensor (one parameter under two names) is one state under its first name: captured and moved once,
    # and the target, parallelised by the same code, ties it again (a target that does not is refused when built).
    for name, p in module.named_parameters():
        if dtype_name(p) not in DTYPE_ITEMSIZE:
            raise ValueError(f"parameter {name!r} has dtype {p.dtype}, which a switch cannot move")
    for name, b in module.named_buffers():
        if isinstance(b, DTensor):
            raise ValueError(f"buffer {name!r} is a DTensor: a switch copies buffers whole; keep buffers plain "
                             "tensors (FSDP2 and TP leave them so)")
        if dtype_name(b) not in DTYPE_ITEMSIZE:
            raise ValueError(f"buffer {name!r} has dtype {b.dtype}, which a switch cannot move; known: "
                             f"{', '.join(DTYPE_ITEMSIZE)}")
    if len(optimizers) > 1:
        raise ValueError(f"configure_optimizers() returned {len(optimizers)} optimizers: a switch carries one")
    names = {id(p): n for n, p in module.named_parameters()}
    for opt in optimizers:
        for p, state in opt.state.items():
            for key, v in state.items():
                try:
                    _routed_entry(p, v)
                except ValueError as e:
                    raise ValueError(
                        f"{type(opt).__name__} keeps {e} as {key!r} of parameter {names.get(id(p), '?')!r}: a switch "
                        "moves optimizer state of the parameter's shape (Adam, AdamW, SGD, RMSprop, Adagrad...) "
                        "plus scalars; use such an optimizer"
                    ) from None
        for group in opt.param_groups:
            missing = [p for p in group["params"] if id(p) not in names]
            if missing:
                raise ValueError(f"{type(opt).__name__} optimizes {len(missing)} tensor(s) that are not parameters of "
                                 "the LightningModule: a switch rebuilds the optimizer from configure_optimizers()")


def capture(module: nn.Module, optimizer, root: DeviceMesh) -> Captured:
    """This rank's view of every routed state of ``module`` and ``optimizer`` (see the module docstring)."""
    specs, shardings, param_of, sources, scalars = [], [], {}, {}, {}
    memo: dict = {}
    for name, p in module.named_parameters():
        sh = sharding_of(p, root, memo)
        specs.append(StateSpec(name, tuple(p.shape), dtype_name(p)))
        shardings.append(sh)
        param_of[name] = (name, None)
        sources[name] = local_tensor(p.detach())
        state = optimizer.state.get(p) if optimizer is not None else None
        for key, v in (state or {}).items():
            if _routed_entry(p, v):
                state_name = f"{name}.{key}"
                specs.append(StateSpec(state_name, tuple(v.shape), dtype_name(v)))
                shardings.append(sh)
                param_of[state_name] = (name, key)
                sources[state_name] = local_tensor(v)
            else:
                scalars.setdefault(name, {})[key] = v.clone() if isinstance(v, torch.Tensor) else v
    for name, b in module.named_buffers():
        whole = b.detach().reshape(1) if b.dim() == 0 else b.detach()
        specs.append(StateSpec(name, tuple(whole.shape), dtype_name(b)))
        shardings.append(sharding_of(whole, root, memo))
        param_of[name] = (name, BUFFER)
        sources[name] = whole
    return Captured(tuple(specs), tuple(shardings), param_of, sources, scalars)


def module_shardings(module: nn.Module, root: DeviceMesh) -> dict[str, tuple[tuple[int, ...], Sharding]]:
    """Every parameter's and buffer's (global shape, sharding) in ``module``, by name."""
    memo: dict = {}
    out = {name: (tuple(p.shape), sharding_of(p, root, memo)) for name, p in module.named_parameters()}
    for name, b in module.named_buffers():
        out[name] = (tuple(b.shape) or (1,), sharding_of(b, root, memo))
    return out


def merged_shardings(builds) -> dict[str, tuple[tuple[int, ...], Sharding]]:
    """`module_shardings` of one build per pipeline stage (``(module, root)`` pairs), as one table: a state two
    stages hold (a buffer every stage keeps) is held by both."""
    out: dict[str, tuple[tuple[int, ...], Sharding]] = {}
    for module, root in builds:
        for name, (shape, sh) in module_shardings(module, root).items():
            if name in out:
                sh = out[name][1].union(sh)
            out[name] = (shape, sh)
    return out


def target_shardings(builds, captured: Captured) -> tuple[Sharding, ...]:
    """Per captured state, its sharding in the target layout, from the same model parallelised for it (``builds``:
    `merged_shardings` input, one build per pipeline stage)."""
    table = merged_shardings(builds)
    root = builds[0][1]
    shapes = {s.name: s.shape for s in captured.specs}
    out = []
    for spec in captured.specs:
        pname, key = captured.param_of[spec.name]
        if pname not in table:
            what = "buffer" if key == BUFFER else "parameter"
            raise ValueError(f"the target model has no {what} {pname!r}: its parallelisation must keep every "
                             f"{what} and its name for every layout")
        shape, sh = table[pname]
        if key != BUFFER and shape != shapes[pname]:
            raise ValueError(f"parameter {pname!r} has shape {shape} in the target model, {shapes[pname]} now")
        out.append(sh)
    extra = sorted(set(table) - {v[0] for v in captured.param_of.values()})
    if extra:
        raise ValueError(f"the target model has parameters or buffers the running one lacks: {extra[:5]}")
    _check_ep_used(root, out)
    return tuple(out)


def _check_ep_used(root: DeviceMesh, shardings: list[Sharding]) -> None:
    """A layout with ep > 1 whose parallelisation splits nothing over ep would run every expert on every rank of
    the ep group while the layout claims otherwise; the user asked for something this model does not do."""
    names = tuple(root.mesh_dim_names or ())
    # With cp, ep is a flattening of root dimensions (vps.parallel_config).
    flat = getattr(root, "_flatten_mapping", {})
    ep_mesh = root["ep"] if "ep" in names else flat.get("ep")
    if ep_mesh is None or ep_mesh.size() == 1:
        return
    ep = next(run for run in _mesh_runs(ep_mesh, root) if run is not None)
    if not any(ep in sh.dims for sh in shardings):
        raise ValueError(
            f"the layout asks for ep={ep_mesh.size()}, but the module's parallelisation splits "
            "no state over the ep mesh dimension (it has no routed experts, or does not apply ExpertParallel): "
            "use ep=1 for this model"
        )
