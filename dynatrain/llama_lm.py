"""`LlamaLM`: the LightningModule that trains a dynatrain Llama model under any strategy with a device mesh."""

from __future__ import annotations

import math
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchmetrics.text import Perplexity

from dynatrain.models.configs import ModelConfig, get_model_config
from dynatrain.models.llama import Transformer
from dynatrain.models.parallelize import dp_submesh, materialize_model, parallelize_model
from dynatrain.vps.parallel_config import ParallelConfig


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine down to ``min_lr_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LlamaLM(pl.LightningModule):
    """Causal language modelling with a Llama-family decoder.

    Args:
        model: a named config (``debug``, ``125m``, ``350m``, ``1b``, ``llama3-8b``, ``llama3-70b``).
        model_overrides: fields of the config to change, e.g. ``{"n_layers": 2}``.
        lr: peak learning rate; warmup_steps: linear warmup; min_lr_ratio: final LR / peak LR of the cosine.
        total_steps: length of the cosine; defaults to the Trainer's ``max_steps``.
    """

    def __init__(
        self,
        model: str = "debug",
        model_overrides: dict | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        total_steps: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model_config: ModelConfig = get_model_config(model).with_overrides(**(model_overrides or {}))
        self.model: Transformer | None = None
        self.val_perplexity = Perplexity()
        self.step_losses: list[float] = []
        self._micro_losses: list[torch.Tensor] = []
        self._step_tokens = 0
        self._step_start: float | None = None

    def setup(self, stage: str) -> None:
        # DynaTrainStrategy keeps the global batch itself (also across layout switches); under another
        # strategy with a mesh, derive gradient accumulation from the data module here.
        strategy = self.trainer.strategy
        datamodule = getattr(self.trainer, "datamodule", None)
        if hasattr(strategy, "dp_size") or not hasattr(datamodule, "accumulation_for"):
            return
        mesh = getattr(strategy, "device_mesh", None)
        names = getattr(mesh, "mesh_dim_names", None) or ()
        dp = mesh["data_parallel"].size() if "data_parallel" in names else self.trainer.world_size
        self.trainer.accumulate_grad_batches = datamodule.accumulation_for(dp)

    # ---- model --------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        if hasattr(datamodule, "check_model_vocab"):
            datamodule.check_model_vocab(self.model_config.vocab_size)
        with torch.device("meta"):
            model = Transformer(self.model_config)
        strategy = self.trainer.strategy
        if hasattr(strategy, "parallelize"):
            strategy.parallelize(model)
        else:
            tp_mesh, dp_mesh = _lightning_meshes(self.device_mesh, self.model_config)
            parallelize_model(model, tp_mesh, dp_mesh)
        if hasattr(strategy, "materialize"):
            strategy.materialize(model)  # a process joining a running job adopts the shards it received
        else:
            materialize_model(model, strategy.root_device)
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, labels = batch
        logits = self.model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return loss, logits, labels

    # ---- training -----------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        if self._step_start is None:
            self._step_start = time.perf_counter()
        loss, _, labels = self._loss(batch)
        self._micro_losses.append(loss.detach())
        self._step_tokens += labels.numel()
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        # The loss of the whole global batch: micro-batches are equal-sized, so it is the mean of their means.
        step_loss = torch.stack(self._micro_losses).mean()
        tokens = torch.tensor(float(self._step_tokens), device=step_loss.device)
        if dist.is_available() and dist.is_initialized():
            # Every rank of a TP group holds the same loss, so the world mean equals the data-parallel mean.
            dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
            step_loss /= dist.get_world_size()
            dist.all_reduce(tokens, op=dist.ReduceOp.SUM)
            tokens /= _tp_size(self.trainer.strategy)
        elapsed = time.perf_counter() - (self._step_start or time.perf_counter())
        self.step_losses.append(step_loss.item())
        self.log("train/loss", step_loss, prog_bar=True, rank_zero_only=True)
        self.log("train/lr", optimizer.param_groups[0]["lr"], rank_zero_only=True)
        if elapsed > 0:
            self.log("train/tokens_per_s", tokens / elapsed, prog_bar=True, rank_zero_only=True)
        self._micro_losses.clear()
        self._step_tokens = 0
        self._step_start = None

    def on_train_step_discarded(self) -> None:
        """dynatrain's hook: a fault discarded the optimizer step in progress, which runs again from its first
        micro-batch; its partial losses must not count."""
        self._micro_losses.clear()
        self._step_tokens = 0
        self._step_start = None

    def validation_step(self, batch, batch_idx: int) -> None:
        loss, logits, labels = self._loss(batch)
        self.val_perplexity.update(logits.float(), labels)
        self.log("val/loss", loss, sync_dist=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.log("val/perplexity", self.val_perplexity.compute(), sync_dist=False)
        self.val_perplexity.reset()

    def configure_optimizers(self):
        hp = self.hparams
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if name.endswith("norm.weight") else decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
        )
        total = hp.total_steps or self.trainer.max_steps
        if total is None or total < 0:
            total = hp.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, total, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _tp_size(strategy) -> int:
    pcfg = getattr(strategy, "parallel_config", None)
    if isinstance(pcfg, ParallelConfig):
        return pcfg.tp
    mesh = getattr(strategy, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1


def _lightning_meshes(mesh, model_config: ModelConfig):
    """(tp mesh, dp mesh) from a mesh built by Lightning's ModelParallelStrategy."""
    names = mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and "data_parallel" in names:
        ParallelConfig(dp_shard=mesh["data_parallel"].size(), tp=mesh["tensor_parallel"].size()).validate(
            model_config
        )
        return mesh["tensor_parallel"], mesh["data_parallel"]
    if "tp" in names:
        pcfg = ParallelConfig(*mesh.shape)
        return mesh["tp"], dp_submesh(mesh, pcfg)
    raise ValueError(
        f"LlamaLM needs a device mesh with dims ('data_parallel', 'tensor_parallel') or (dp_replicate, dp_shard, tp);"
        f" got {names}"
    )
