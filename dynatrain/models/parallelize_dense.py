"""The dense kind's ``parallelize_fn`` (`models.registry`): a `Transformer` built on the meta device, parallelised for
a layout in torchtitan's order.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from dynatrain.models.configs import ModelConfig
from dynatrain.models.dense_specs import pipeline_stage_split
from dynatrain.models.llama import Transformer
from dynatrain.models.parallelize import (
    ParallelizeOptions,
    apply_block_options,
    apply_cp,
    apply_fsdp,
    apply_tp,
    dense_meshes,
    materialize_model,
    split_for_pp,
)
from dynatrain.vps.parallel_config import ParallelConfig


def parallelize_dense(model: Transformer, mesh: DeviceMesh, pcfg: ParallelConfig,
                      options: ParallelizeOptions | None = None) -> Transformer:
    """Parallelise ``model`` for ``pcfg`` on ``mesh``, in this order:

    - cp: each sequence split over the cp ranks (`models.context_parallel`), before a pipeline split so the stages'
      views copy it;
    - pp: the model keeps the layers of this rank's stages (`dense_specs.pipeline_stage_split`, balanced by the
      zoo's cost), everything below on the stage's sub-mesh;
    - tp: projections, embeddings and the output projection split as `tp_styles` says (``sequence_parallel``,
      ``loss_parallel`` from ``options``);
    - activation checkpointing, then `torch.compile`, per block;
    - FSDP2 over the data-parallel ranks (``dp_shard x cp``, HSDP with ``dp_replicate``): each block, then the root
      (each stage's view under pp).

    ``mesh`` is dynatrain's (``pcfg.mesh_dim_names``) or Lightning ModelParallelStrategy's (``data_parallel``,
    ``tensor_parallel``)."""
    options = options or ParallelizeOptions()
    pcfg.validate(model.config)  # tp against heads, KV heads, feed-forward and vocabulary; pp against the layers
    apply_cp(model, mesh, pcfg)
    stages = None
    if pcfg.pp > 1:
        split = pipeline_stage_split(model.config, pcfg.pp, options.stages_per_rank)
        stages = split_for_pp(model, mesh, pcfg, split, options.stages_per_rank)
    tp_mesh, dp_mesh = dense_meshes(mesh, pcfg)
    apply_tp(model, tp_mesh, sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel)
    apply_block_options(model, options.activation_checkpointing, options.compile_backend)
    return apply_fsdp(model, dp_mesh, options.mp_policy, stages)


def build_parallel_model(model_cfg: ModelConfig, pcfg: ParallelConfig, mesh: DeviceMesh,
                         options: ParallelizeOptions | None = None, device: torch.device | str | None = None,
                         materialize: bool = True) -> Transformer:
    """The dense model for ``pcfg`` on ``mesh``: built on meta, parallelised, then (optionally) materialised."""
    pcfg.validate(model_cfg, mesh.size())
    with torch.device("meta"):
        model = Transformer(model_cfg)
    parallelize_dense(model, mesh, pcfg, options)
    if materialize:
        materialize_model(model, device or torch.device(mesh.device_type))
    return model
