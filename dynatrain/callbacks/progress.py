"""A plain-text progress line every N optimizer steps: readable in CI logs and `make demo`, unlike a redrawn bar."""

from __future__ import annotations

import time

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info


class StepPrinter(pl.Callback):
    def __init__(self, every_n_steps: int = 10) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._start = 0.0
        self._printed_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()
        layout = getattr(trainer.strategy, "parallel_config", None)
        rank_zero_info(
            f"training on {trainer.world_size} process(es)"
            + (f", layout {layout.short()}" if layout is not None else "")
            + f", gradient accumulation {trainer.accumulate_grad_batches}"
        )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        losses = getattr(pl_module, "step_losses", None)
        step = trainer.global_step
        # Micro-batches outnumber steps under gradient accumulation: print each step once.
        if not losses or len(losses) != step or step % self.every_n_steps or step == self._printed_step:
            return
        self._printed_step = step
        metrics = trainer.callback_metrics
        parts = [f"step {step:>5}", f"loss {losses[-1]:.4f}"]
        if "train/tokens_per_s" in metrics:
            parts.append(f"tokens/s {float(metrics['train/tokens_per_s']):,.0f}")
        if "moe/imbalance_max" in metrics:
            parts.append(f"expert load max/mean {float(metrics['moe/imbalance_max']):.2f}")
        if "val/loss" in metrics:
            parts.append(f"val/loss {float(metrics['val/loss']):.4f}")
        layout = getattr(trainer.strategy, "parallel_config", None)
        if layout is not None:
            parts.append(f"layout {layout.short()} on {trainer.world_size}")
        parts.append(f"{time.perf_counter() - self._start:.0f}s")
        rank_zero_info("  ".join(parts))
