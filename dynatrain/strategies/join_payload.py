"""What a joiner receives over the job's store, as JSON: the states of a world change with their old and new
placements, the optimizer's kept scalars, and the loop state as of the switch boundary (`loop_checkpoint`, also
what a snapshot saves beside the states)."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import torch

from dynatrain.vps.layout import StateSpec
from dynatrain.vps.placement import Replicate, Shard, Sharding, StridedShard


def _encode_sharding(sh: Sharding) -> list:
    kinds = [["R"] if isinstance(p, Replicate) else ["S", p.dim] if isinstance(p, Shard) else
             ["SS", p.dim, p.split_factor] for p in sh.placements]
    held = None if sh.held is None else [sh.held[0], list(sh.held[1])]
    return [list(sh.mesh_shape), kinds, [list(run) for run in sh.dims], held]


def _decode_sharding(row: list) -> Sharding:
    mesh, kinds, dims, held = row
    make = {"R": lambda: Replicate(), "S": lambda d: Shard(d), "SS": lambda d, f: StridedShard(d, f)}
    return Sharding(tuple(mesh), tuple(make[k[0]](*k[1:]) for k in kinds), tuple(tuple(r) for r in dims),
                    None if held is None else (held[0], tuple(held[1])))


def encode_specs(specs, old_shardings, new_shardings) -> list:
    """The states of a world change with their old and new placements, as JSON for a joiner."""
    return [[s.name, list(s.shape), s.dtype, _encode_sharding(a), _encode_sharding(b)]
            for s, a, b in zip(specs, old_shardings, new_shardings)]


def decode_specs(rows: list) -> tuple[tuple[StateSpec, ...], tuple[Sharding, ...], tuple[Sharding, ...]]:
    specs = tuple(StateSpec(n, tuple(shape), dtype) for n, shape, dtype, _, _ in rows)
    return (specs, tuple(_decode_sharding(r[3]) for r in rows), tuple(_decode_sharding(r[4]) for r in rows))


def encode_scalars(scalars: dict[str, dict]) -> dict:
    out = {}
    for name, entries in scalars.items():
        out[name] = {k: ({"tensor": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
                         if isinstance(v, torch.Tensor) else v) for k, v in entries.items()}
    return out


def decode_scalars(encoded: dict, device: torch.device) -> dict[str, dict]:
    out = {}
    for name, entries in encoded.items():
        out[name] = {k: (torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"]), device=device)
                         if isinstance(v, dict) and "tensor" in v else v) for k, v in entries.items()}
    return out


def loop_checkpoint(trainer: pl.Trainer) -> dict:
    """The part of a Lightning checkpoint that is not model or optimizer state, as of the switch boundary."""
    ckpt: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": pl.__version__,
        "loops": {"fit_loop": _fit_loop_state(trainer)},
        "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
    }
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None:
        ckpt[type(datamodule).__qualname__] = datamodule.state_dict()
    ckpt["callbacks"] = _callback_states(trainer)
    return json.loads(json.dumps(ckpt))  # what crosses the store is JSON: fail here, not on the joiner


def _fit_loop_state(trainer: pl.Trainer) -> dict:
    """Lightning's fit loop as of the switch boundary, in the form a checkpoint saved by a callback at the end of that
    micro-batch has (its batch counted as processed, not yet completed). At an epoch's last micro-batch, Lightning
    resumes from that form into the next epoch, as the run itself goes on; from a completed last batch it would
    restart the finished epoch with one more step of its loop (a collective) than the members of the run take."""
    state = trainer.fit_loop.state_dict()
    progress = state.get("epoch_loop.batch_progress")
    if progress is not None and progress.get("is_last_batch"):
        for part in ("total", "current"):
            counts = progress[part]
            counts["completed"] = min(counts["completed"], counts["processed"] - 1)
    return state


def _callback_states(trainer: pl.Trainer) -> dict[str, dict]:
    """Stateful callbacks' `state_dict`s, so a joiner resumes them where the members are (a scripted sequence
    of requests, for one). A state that is not plain JSON (tensors, paths) stays behind: the joiner's callback
    then starts fresh, as it does without a checkpoint."""
    out = {}
    for cb in trainer.callbacks:
        state = cb.state_dict()
        if not state:
            continue
        try:
            out[cb.state_key] = json.loads(json.dumps(state))
        except (TypeError, ValueError):
            continue
    return out
