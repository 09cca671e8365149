"""The training loop's state at a switch boundary: the part of a Lightning checkpoint that is not model or
optimizer state, as JSON; what a joining process resumes from, and what a snapshot saves beside the states."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl


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
