"""The loss of the same run without switches, for comparing an elastic run against it.

`ReferenceLoss` replays the run after training, on global rank 0 alone: a fresh `CausalLM` built from the run's
own hyper-parameters on one process, the same layout-independent initial weights, the same optimizer and LR
schedule (the module's own ``configure_optimizers``), and the same global batches in the same order (the data
module's `GlobalBatchSampler` defines them whatever the world size). What differs from the elastic run is only
where the sums happen: no layout switch, no world change. Its losses go to ``reference_loss.csv`` next to
``switches.jsonl``, where `plot_loss_with_switches` draws them under the run's own.

It replays after training rather than alongside it: a step computed alongside would hold every rank at the next
collective and show up as stall in the very switches it is compared with. The cost is one single-process run of
the recipe on rank 0 (with every CPU core, the other ranks being idle meanwhile), so it suits models that train on
one process in reasonable time (the debug models of the demos).
"""

from __future__ import annotations

import csv
import inspect
import math
import os
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import default_collate

from dynatrain.callbacks.switch_log import REFERENCE_NAME, SwitchLog

_FP32 = ("32-true", "32")


class ReferenceLoss(pl.Callback):
    """After training, rank 0 trains the same model on the same global batches on one process, with no switches,
    and writes each step's loss to ``reference_loss.csv``.

    Args:
        log_dir: where the file goes; default the run directory of the run's `SwitchLog` (next to
            ``switches.jsonl``), else the first logger's ``log_dir``, else ``trainer.default_root_dir``.
        wait_timeout_s: how long the other ranks wait for rank 0's replay before they fail.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, wait_timeout_s: float = 3600.0) -> None:
        self.log_dir = log_dir
        self.wait_timeout_s = wait_timeout_s
        self.path: Path | None = None
        self.losses: list[float] = []
        self.seconds: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Refused before any step: a reference that cannot reproduce the run is worse than none.
        from dynatrain.lm.causal_lm import CausalLM

        if stage != "fit":
            return
        if not isinstance(pl_module, CausalLM):
            raise ValueError(f"ReferenceLoss replays dynatrain's CausalLM; this run trains {type(pl_module).__name__}: "
                             "remove ReferenceLoss from the callbacks")
        if str(trainer.precision) not in _FP32:
            raise ValueError(f"ReferenceLoss reproduces fp32 runs (precision '32-true'); this run has precision "
                             f"{trainer.precision!r}: set trainer.precision to 32-true or remove ReferenceLoss")
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError("ReferenceLoss clips gradients by norm only; set gradient_clip_algorithm to 'norm' or "
                             "remove ReferenceLoss")
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "train_set") or not hasattr(datamodule, "micro_batch_size"):
            raise ValueError("ReferenceLoss reads the global batches of a LlamaDataModule (train_set, "
                             f"train_sampler, micro_batch_size); this run's data module is {type(datamodule).__name__}")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step < 1:
            return
        try:
            if trainer.is_global_zero:
                self._replay(trainer, pl_module)
        finally:
            # The other ranks wait here, not at the job's final barrier, whose timeout a replay may outlast.
            _wait_for_rank_zero(self.wait_timeout_s)

    def _replay(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(os.cpu_count() or threads)  # the other ranks are idle until it is done
        start = time.perf_counter()
        try:
            self.losses = replay(pl_module, trainer.datamodule, trainer.global_step, trainer.gradient_clip_val,
                                 device)
        finally:
            torch.set_num_threads(threads)
        self.seconds = time.perf_counter() - start
        self.path = write_reference(self._run_dir(trainer) / REFERENCE_NAME, self.losses)
        run = list(getattr(pl_module, "step_losses", []))
        diff = max_difference(run, self.losses) if len(run) == len(self.losses) else None
        against = "" if diff is None else f"; this run's loss differs by at most {diff:.2g}"
        rank_zero_info(f"reference without switches: {len(self.losses)} steps on 1 process in {self.seconds:.1f}s"
                       f"{against}")

    def _run_dir(self, trainer: pl.Trainer) -> Path:
        # Rank 0 alone gets here: trainer.log_dir would broadcast, so it is read from the loggers directly.
        if self.log_dir is not None:
            return Path(self.log_dir)
        switch_log = next((cb for cb in trainer.callbacks if isinstance(cb, SwitchLog)), None)
        if switch_log is not None and switch_log.run_dir is not None:
            return switch_log.run_dir
        if trainer.loggers:
            logger = trainer.loggers[0]
            return Path(getattr(logger, "log_dir", None) or logger.save_dir or trainer.default_root_dir)
        return Path(trainer.default_root_dir)


def _wait_for_rank_zero(timeout_s: float) -> None:
    # A gloo group of its own: its timeout is this wait's alone, and it works whatever the job's backend is.
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    try:
        dist.barrier(group=group)
    finally:
        dist.destroy_process_group(group)


def replay(pl_module: pl.LightningModule, datamodule, steps: int, clip_norm: float | None = None,
           device: torch.device | str = "cpu") -> list[float]:
    """The loss of each of the first ``steps`` optimizer steps of ``pl_module``'s run, trained again from its
    initial weights on this process alone, on the data module's global batches."""
    from dynatrain.lm import moe_load
    from dynatrain.models.parallelize import materialize_model
    from dynatrain.strategies.lightning_internals import trainer_of

    # Only the constructor's own arguments: LightningCLI adds entries of its own (``_instantiator``).
    accepted = inspect.signature(type(pl_module).__init__).parameters
    copy = type(pl_module)(**{k: v for k, v in pl_module.hparams.items() if k in accepted})
    if trainer_of(pl_module) is not None:
        copy.trainer = pl_module.trainer  # its configure_optimizers reads the run's max_steps, as the run's did
    with torch.device("meta"):
        model = copy.model_spec.build(copy.model_config)
    materialize_model(model, device)
    copy.model = model
    setup = copy.configure_optimizers()
    optimizer, scheduler = setup["optimizer"], setup["lr_scheduler"]["scheduler"]
    sampler, dataset, micro = datamodule.train_sampler, datamodule.train_set, datamodule.micro_batch_size
    losses = []
    model.train()
    for step in range(steps):
        indices = sampler.global_batch(step)
        chunks = [indices[i:i + micro] for i in range(0, len(indices), micro)]
        for chunk in chunks:
            batch = [t.to(device) for t in default_collate([dataset[i] for i in chunk])]
            # The module's own training step: the same loss (and MoE auxiliary loss) as the run's.
            (copy.training_step(batch, 0) / len(chunks)).backward()
        losses.append(torch.stack(copy._micro_losses).mean().item())
        if copy.routed_experts:
            moe_load.apply_load(model, moe_load.local_counts(model))
        copy._clear_step()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def max_difference(a: list[float], b: list[float]) -> float:
    """The largest absolute difference of two loss curves over their common steps (inf where one is not finite)."""
    diffs = [abs(x - y) if math.isfinite(x) and math.isfinite(y) else math.inf for x, y in zip(a, b)]
    return max(diffs, default=0.0)


def write_reference(path: str | os.PathLike, losses: list[float]) -> Path:
    """``step,loss`` rows; step k is the k-th optimizer step (0-based), as in the run's ``train/loss``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss"])
        writer.writerows([step, repr(loss)] for step, loss in enumerate(losses))
    return path
