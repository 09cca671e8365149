"""The pieces every kind's parallelisation is made of (`models.parallelize_dense`, `models.parallelize_moe`, each
named by its kind's `ModelSpec`) and the default one of a module without a kind (`models.auto_parallel` shares the
meshes): the device mesh of a layout, `apply_cp`, the pipeline split, `apply_tp`, activation checkpointing and
compile per block (`apply_block_options`), `apply_fsdp`, then materialisation, on a model built on the meta device.

The order matters: TP first turns weights into DTensors on the tp mesh dimension; FSDP2 then shards dim 0
of each TP-local tensor over the data-parallel dimensions (HSDP when dp_replicate > 1). Checkpointing and
compilation replace a block's forward in place and wrap no module, so parameter names stay those of the plain model.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dynatrain.models import tp_styles
from dynatrain.models.checkpointing import ActivationCheckpointing, apply_ac
from dynatrain.models.compile import apply_compile
from dynatrain.models.context_parallel import enable_context_parallel
from dynatrain.models.decoder import Attention
from dynatrain.models.pipeline_split import PipelineStages, split_model
from dynatrain.vps.parallel_config import ParallelConfig


@dataclass(frozen=True)
class ParallelizeOptions:
    """What a kind's ``parallelize_fn`` reads beside the mesh and the layout (torchtitan's job config): the same for
    the first model and for every switch's target. The defaults are those of a strategy that asks for nothing
    (Lightning's ModelParallelStrategy)."""

    mp_policy: MixedPrecisionPolicy | None = None
    sequence_parallel: bool = False
    stages_per_rank: int = 1  # pipeline stages per pp rank (interleaved schedules take more than one)
    loss_parallel: bool = False  # logits left split over the vocabulary (tp > 1)
    activation_checkpointing: ActivationCheckpointing | str | None = None
    compile_backend: str | None = None


def init_mesh(pcfg: ParallelConfig, device_type: str = "cpu", ranks: Sequence[int] | None = None) -> DeviceMesh:
    """The root mesh of ``pcfg`` (``pcfg.mesh_dim_names``) with its flattened names (``pcfg.flattened_dims()``).
    ``ranks[i]`` is the process at default position i (position = (r*S + s)*T + t); every rank of the default
    group must call this, member or not."""
    order = list(range(pcfg.world_size)) if ranks is None else [int(r) for r in ranks]
    if len(order) != pcfg.world_size or len(set(order)) != len(order):
        raise ValueError(f"layout {pcfg} needs {pcfg.world_size} distinct ranks, got {order}")
    if not mesh_safe(order, pcfg):
        raise ValueError(
            f"rank arrangement {order} for {pcfg.short()} is not ascending along every mesh dimension: torch "
            "creates each mesh group with sorted ranks, so its collectives would disagree with the mesh coordinates"
        )
    mesh = DeviceMesh(device_type, torch.tensor(order, dtype=torch.int).view(pcfg.mesh_shape),
                      mesh_dim_names=pcfg.mesh_dim_names)
    for name, dims in pcfg.flattened_dims().items():
        mesh[dims]._flatten(name)
    return mesh


def mesh_groups(mesh: DeviceMesh, pcfg: ParallelConfig, min_size: int = 2) -> list:
    """The process groups of ``mesh`` this rank belongs to with ``min_size`` ranks or more, each once: every root
    dimension and every flattened name of ``pcfg``, in that order (the same on every rank). The mesh made a group
    for each, one-rank dimensions included."""
    groups, seen = [], set()
    # A flattened name is read from the flattenings the mesh keeps: slicing it from the root is deprecated in torch.
    flat = getattr(mesh, "_flatten_mapping", {})
    for name in (*pcfg.mesh_dim_names, *pcfg.flattened_dims()):
        sub = flat[name] if name in flat else mesh[name]
        if sub.size() < min_size:
            continue
        group = sub.get_group()
        if id(group) not in seen:
            seen.add(id(group))
            groups.append(group)
    return groups


def connect_mesh_groups(mesh: DeviceMesh, pcfg: ParallelConfig, device: torch.device | str) -> int:
    """Run one one-element all-reduce on each group of ``mesh`` (`mesh_groups`); returns how many this rank joined.

    NCCL creates a group's communicator at its first collective, and that would otherwise be the new layout's
    first all-gather, inside the first training step. Every rank of the mesh must call this, in the same order as
    `init_mesh`: each rank joins one group per dimension, the dimensions come in the same order everywhere, and
    the groups of one dimension are disjoint, so the collectives cannot wait on each other in a cycle. Gloo
    connects at creation; there this adds a round trip per group."""
    groups = mesh_groups(mesh, pcfg)
    for group in groups:
        torch.distributed.all_reduce(torch.zeros(1, device=device), group=group)
    return len(groups)


def mesh_safe(ranks: Sequence[int], pcfg: ParallelConfig) -> bool:
    """True when ranks ascend along every dimension of the (pp, dp_replicate, dp_shard x cp, tp) mesh.

    `new_group` sorts its ranks, so a group's rank order equals the mesh order only for such arrangements;
    any other one silently permutes all-gathers and reduce-scatters. FSDP's group spans dp_shard x cp flattened
    (and ep's a run of it): ascending along dp_shard and along cp apart is not enough ([0, 2, 1, 3] for
    dp_shard=2,cp=2 would gather every state's shards out of order).
    """
    grid = np.asarray(ranks, dtype=np.int64).reshape(pcfg.pp, pcfg.dp_replicate, pcfg.fsdp_shard, pcfg.tp)
    return all(bool((np.diff(grid, axis=axis) > 0).all()) for axis in range(grid.ndim))


def _style(style: str, sequence_parallel: bool):
    seq = Shard(1) if sequence_parallel else Replicate()
    if style == tp_styles.COLWISE:
        return ColwiseParallel()
    if style == tp_styles.ROWWISE:
        return RowwiseParallel(output_layouts=seq)
    if style == tp_styles.EMBEDDING:
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if style == tp_styles.REPLICATE:
        return SequenceParallel() if sequence_parallel else None
    raise ValueError(f"unknown tensor-parallel style {style!r}")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
             block_plan: dict[str, str] = tp_styles.BLOCK_PLAN, loss_parallel: bool = False) -> nn.Module:
    """Shard the projections over ``tp_mesh`` as `tp_styles` says (``block_plan`` for each of ``model.layers``);
    norms stay replicated. The logits come out whole on every rank, or, with ``loss_parallel``, as a DTensor split
    over the vocabulary, for a loss computed under `torch.distributed.tensor.parallel.loss_parallel` (never
    gathered whole; its backward must run under it too)."""
    if tp_mesh.size() == 1:
        return model
    top = {name: _style(style, sequence_parallel) for name, style in tp_styles.TOP_PLAN.items()}
    seq = Shard(1) if sequence_parallel else Replicate()
    top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False) \
        if loss_parallel else ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    # A pipeline stage lacks the parts other stages hold.
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items()
                                        if v is not None and getattr(model, k, None) is not None})
    for block in model.layers.values():
        plan = {name: _style(style, sequence_parallel) for name, style in block_plan.items()}
        if sequence_parallel:
            plan["attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            )
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, tp_mesh, {k: v for k, v in plan.items() if v is not None})
    return model


def apply_cp(model: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> None:
    """Make ``model`` and every attention in it split sequences over the layout's cp ranks
    (`models.context_parallel`); nothing without cp. Before a pipeline split: the stages' views copy it."""
    if pcfg.cp == 1:
        return
    cp_mesh = mesh["cp"]
    enable_context_parallel(model, cp_mesh)
    for module in model.modules():
        if isinstance(module, Attention):
            enable_context_parallel(module, cp_mesh)


def split_for_pp(model: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig, split: tuple[tuple[int, int], ...],
                 stages_per_rank: int) -> PipelineStages:
    """Keep the layers (and the embedding or head) of the stages this rank's pp coordinate runs, in place, ``split``
    giving each of the ``pp * stages_per_rank`` stages its layers (`models.pipeline_split`); what is applied after
    it runs on the stage's sub-mesh. After `apply_cp`: the stages' views copy the model's."""
    # From the mesh's coordinates, not the pp group: a probe mesh's groups are not registered with c10d.
    coordinate = mesh.get_coordinate()[mesh.mesh_dim_names.index("pp")]
    return split_model(model, split, pcfg.pp, coordinate, stages_per_rank)


def apply_block_options(model: nn.Module, activation_checkpointing: ActivationCheckpointing | str | None = None,
                        compile_backend: str | None = None) -> None:
    """Activation checkpointing, then `torch.compile`, on every block of ``model.layers`` (between TP and FSDP)."""
    apply_ac(model, activation_checkpointing)
    apply_compile(model, compile_backend)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None,
               stages: PipelineStages | None = None) -> nn.Module:
    """`fully_shard` every block, then the root (embeddings, final norm, output); a model split into ``stages``
    by the stages' views (`apply_fsdp_stages`)."""
    if stages is not None:
        apply_fsdp_stages(stages, dp_mesh, mp_policy)
        return model
    kwargs = {"mesh": dp_mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_fsdp_stages(stages: PipelineStages, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
                      ) -> None:
    """`fully_shard` every block of the rank's stages, then each stage's view as the root of its stage (its
    embedding or head beneath it). Blocks keep their parameters gathered between forward and backward: a pipeline
    runs every micro-batch's forward before its backward, and would gather them again for each."""
    kwargs = {"mesh": dp_mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for view in stages.views:
        for block in view.layers.values():
            fully_shard(block, reshard_after_forward=False, **kwargs)
        fully_shard(view, reshard_after_forward=False, **kwargs)


def dp_submesh(mesh: DeviceMesh, pcfg: ParallelConfig) -> DeviceMesh:
    """The mesh FSDP2 shards dense states over: ``dp_shard`` (``dp_shard x cp`` with cp, as torchtitan: the cp ranks
    of a sample hold different tokens, so their gradients are reduced as data parallelism's), with ``dp_replicate``
    in front for HSDP."""
    shard = "dp_shard_cp" if pcfg.cp > 1 else "dp_shard"
    with warnings.catch_warnings():
        # With ep or cp, the shard dimension is a flattened name; slicing it beside a root dimension is the one way
        # to a 2-D HSDP mesh that torch offers, and it warns about a future deprecation of exactly that.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh will be deprecated")
        return mesh["dp_replicate", shard] if pcfg.dp_replicate > 1 else mesh[shard]


def dense_meshes(mesh: DeviceMesh, pcfg: ParallelConfig) -> tuple[DeviceMesh, DeviceMesh]:
    """(tp mesh, data-parallel mesh) of ``pcfg`` on dynatrain's mesh (``pcfg.mesh_dim_names``) or on Lightning
    ModelParallelStrategy's (``data_parallel``, ``tensor_parallel``), which has no ep dimension."""
    names = tuple(mesh.mesh_dim_names or ())
    if "tp" in names:
        return mesh["tp"], dp_submesh(mesh, pcfg)
    if {"data_parallel", "tensor_parallel"} <= set(names):
        if pcfg.ep > 1:
            raise ValueError(f"ep={pcfg.ep} needs dynatrain's mesh (an ep dimension); Lightning's mesh {names} has "
                             "none: use strategy='dynatrain' or ep=1")
        if pcfg.cp > 1:
            raise ValueError(f"cp={pcfg.cp} needs dynatrain's mesh (a cp dimension); Lightning's mesh {names} has "
                             "none: use strategy='dynatrain' or cp=1")
        return mesh["tensor_parallel"], mesh["data_parallel"]
    raise ValueError(f"a device mesh with dims {pcfg.mesh_dim_names} or ('data_parallel', 'tensor_parallel') is "
                     f"needed, got {names}")


def allocate_model(model: nn.Module, device: torch.device | str) -> None:
    """Storage for every local shard, left uninitialised (a switch fills it), and the buffers recomputed."""
    device = torch.device(device)
    model.to_empty(device=device)
    model.init_buffers(device)


def materialize_model(model: nn.Module, device: torch.device | str) -> None:
    device = torch.device(device)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
