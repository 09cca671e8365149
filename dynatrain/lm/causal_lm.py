"""`CausalLM` (also importable as `LlamaLM`): the LightningModule that trains the zoo's decoders, dense Llama and
mixture-of-experts, under any strategy with a device mesh (MoE models under strategy="dynatrain")."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torchmetrics.text import Perplexity

from dynatrain.lm import moe_load
from dynatrain.models.context_parallel import shard_labels
from dynatrain.models.parallelize import ParallelizeOptions, materialize_model
from dynatrain.models.registry import ModelSpec, ZooConfig, spec_for
from dynatrain.vps.parallel_config import ParallelConfig


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine down to ``min_lr_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CausalLM(pl.LightningModule):
    """Causal language modelling with one of the zoo's decoders.

    A mixture-of-experts model adds its load-balancing loss to the training loss; once per optimizer step the
    tokens each expert received are summed over the data-parallel ranks, move the expert bias, and are logged as
    ``moe/layer{i}/imbalance`` (busiest expert / mean), ``moe/imbalance_max`` and, with ``log_expert_tokens``,
    ``moe/layer{i}/expert{e}_tokens`` every ``log_every_n_steps``.

    Args:
        model: a named config: dense (``debug``, ``125m``, ``350m``, ``1b``, ``llama3-8b``, ``llama3-70b``) or a
            mixture of experts (``moe-debug``, ``moe-small``, ``qwen3-30b-a3b``, ``qwen3-235b-a22b``,
            ``mixtral-8x7b``).
        model_overrides: fields of the config to change, e.g. ``{"n_layers": 2}``.
        lr: peak learning rate; warmup_steps: linear warmup; min_lr_ratio: final LR / peak LR of the cosine.
        total_steps: length of the cosine; defaults to the Trainer's ``max_steps``.
        log_expert_tokens: also log every expert's token count (n_layers x n_experts scalars; turn it off for
            large models, the imbalance figures stay).
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
        log_expert_tokens: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model_config: ZooConfig = moe_load.zoo_config(model, model_overrides)
        self.model: torch.nn.Module | None = None
        self.val_perplexity = Perplexity()
        self.step_losses: list[float] = []
        # The job's tokens per expert of the last optimizer step, [n_layers, n_experts] (MoE models).
        self.expert_load: torch.Tensor | None = None
        self._micro_losses: list[torch.Tensor] = []
        self._micro_aux: list[torch.Tensor] = []
        self._pipeline_val: list[torch.Tensor] = []
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
        strategy = self.trainer.strategy
        spec = self.model_spec
        with torch.device("meta"):
            model = spec.build(self.model_config)
        # dynatrain's strategy holds what it was asked for (checkpointing, compile, pp stages per rank...); Lightning's
        # ModelParallelStrategy asks for nothing beyond its mesh.
        options = getattr(strategy, "parallelize_options", None) or ParallelizeOptions()
        spec.parallelize_fn(model, self.device_mesh, _layout(self.device_mesh, strategy), options)
        if hasattr(strategy, "materialize"):
            strategy.materialize(model)  # a process joining a running job adopts the shards it received
        else:
            materialize_model(model, strategy.root_device)
        self.model = model

    @property
    def model_spec(self) -> ModelSpec:
        """The kind of the model (`models.registry`): how it is built and parallelised."""
        return spec_for(self.model_config)

    @property
    def routed_experts(self) -> bool:
        """Whether the model routes tokens to experts: it has an auxiliary loss and router load to balance."""
        return self.model_spec.routed_experts

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, labels = batch
        logits = self.model(tokens)
        # With context parallelism the logits are those of this rank's part of each sequence.
        labels = shard_labels(self.model, labels)
        return _cross_entropy(logits, labels), logits, labels

    def loss_context(self):
        """What the loss's backward runs under: with the strategy's loss parallelism the logits are split over the
        vocabulary (tp > 1), and torch's vocabulary-parallel cross entropy needs its backward inside
        `loss_parallel` too. Harmless where nothing is split."""
        options = getattr(self.trainer.strategy, "parallelism", None)  # a DynaTrainStrategy's
        return _VocabParallel() if getattr(options, "loss_parallel", False) else nullcontext()

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        with self.loss_context():
            super().backward(loss, *args, **kwargs)

    # ---- training -----------------------------------------------------------------------------------------
    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, _, labels = self._loss(batch)
        self._record(loss, labels)
        aux = self.model.aux_loss() if self.routed_experts else None
        if aux is None:
            return loss
        self._micro_aux.append(aux.detach())
        return loss + aux

    def _record(self, loss: torch.Tensor, labels: torch.Tensor) -> None:
        self._micro_losses.append(loss.detach())
        self._step_tokens += labels.numel()

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch on the last pipeline stage (pp > 1: the strategy runs the schedule)."""
        return _cross_entropy(logits, shard_labels(self.model, labels))

    def on_pipeline_losses(self, losses: list[torch.Tensor], labels: torch.Tensor) -> None:
        """The step's micro-batch losses, on the last pipeline stage (none elsewhere)."""
        for loss, part in zip(losses, labels.chunk(len(losses)) if losses else ()):
            self._record(loss, shard_labels(self.model, part))

    def on_pipeline_shapes_inferred(self) -> None:
        """The pipeline's first step ran an extra forward and backward to learn the shapes between stages (on
        placeholder activations past the first stage): what its routers counted is not the step's load."""
        if self.routed_experts:
            moe_load.reset_counts(self.model)

    def on_pipeline_validation_loss(self, loss: torch.Tensor) -> None:
        self.log("val/loss", loss, sync_dist=True, prog_bar=True)
        self._pipeline_val.append(loss.detach())

    def on_before_optimizer_step(self, optimizer) -> None:
        # The loss of the whole global batch: micro-batches are equal-sized, so it is the mean of their means. Under
        # pp only the last stage computes losses: the mean is over the ranks that hold one.
        device = self.device if self.device.type != "meta" else torch.device("cpu")
        held = torch.stack(self._micro_losses).mean() if self._micro_losses else torch.zeros((), device=device)
        has = torch.ones_like(held) if self._micro_losses else torch.zeros_like(held)
        pp = _pp_size(self.trainer.strategy)
        # Under pp no training_step sees the auxiliary loss: each stage sums its own layers' over the step.
        staged = moe_load.stage_aux(self.model) if pp > 1 and self.routed_experts else None
        aux = torch.stack(self._micro_aux).mean() if self._micro_aux else \
            staged.to(held) if staged is not None else torch.zeros_like(held)
        tokens = torch.tensor(float(self._step_tokens), device=held.device)
        counts = moe_load.local_counts(self.model) if self.routed_experts else held.new_zeros(0, 0)
        # One collective for the step's figures: losses, tokens and every router's counts.
        flat = torch.cat([torch.stack([held, aux, tokens, has]).float(), counts.flatten().to(held.device)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            # Every rank of a TP group holds the same loss and routes the same tokens: the mean over the ranks
            # holding a loss is the data-parallel mean, and token sums count each data-parallel rank tp times. Under
            # pp each stage's ranks hold their layers' auxiliary loss and counts only: the sum over stages is whole.
            # The cp ranks of a sample hold as many tokens each, and count and route only theirs: the mean of their
            # losses (auxiliary ones included, `models.moe.MoE`) is the sample's, their token sums are whole.
            tp = _tp_size(self.trainer.strategy)
            flat[0] /= flat[3]
            flat[1] /= dist.get_world_size() // pp
            flat[2] /= tp
            flat[4:] /= tp
        step_loss, aux, tokens = flat[0], flat[1], flat[2]
        elapsed = time.perf_counter() - (self._step_start or time.perf_counter())
        self.step_losses.append(step_loss.item())
        self.log("train/loss", step_loss, prog_bar=True, rank_zero_only=True)
        self.log("train/lr", optimizer.param_groups[0]["lr"], rank_zero_only=True)
        if elapsed > 0:
            self.log("train/tokens_per_s", tokens / elapsed, prog_bar=True, rank_zero_only=True)
        if self._micro_aux or staged is not None:
            self.log("train/aux_loss", aux, rank_zero_only=True)
        if self.routed_experts:
            self._expert_load_step(flat[4:].view_as(counts))
        self._clear_step()

    def _expert_load_step(self, counts: torch.Tensor) -> None:
        """The step's job-wide tokens per expert: move the expert bias (the routing of the next forward), keep
        them for the switch log, and log the load when the loggers are written."""
        moe_load.apply_load(self.model, counts)
        self.expert_load = counts.detach().cpu().clone()
        every = self.trainer.log_every_n_steps
        # Lightning writes this step's metrics when (steps done + 1) is a multiple of log_every_n_steps.
        if every and (self.trainer.global_step + 1) % every == 0:
            for key, value in moe_load.load_metrics(self.expert_load, self.hparams.log_expert_tokens).items():
                self.log(key, value, rank_zero_only=True)

    def expert_imbalance(self) -> list[float] | None:
        """Per layer, the busiest expert's tokens over the mean at the last optimizer step (None before one, or for
        a dense model)."""
        return None if self.expert_load is None else moe_load.imbalance(self.expert_load).tolist()

    def _clear_step(self) -> None:
        self._micro_losses.clear()
        self._micro_aux.clear()
        self._step_tokens = 0
        self._step_start = None

    def on_train_step_discarded(self) -> None:
        """dynatrain's hook: a fault discarded the optimizer step in progress, which runs again from its first
        micro-batch; its partial losses and routed tokens must not count."""
        self._clear_step()
        if self.routed_experts and self.model is not None:
            moe_load.reset_counts(self.model)

    def validation_step(self, batch, batch_idx: int) -> None:
        loss, logits, labels = self._loss(batch)
        if isinstance(logits, DTensor):  # split over the vocabulary: the metric needs every class
            logits = logits.full_tensor()
        self.val_perplexity.update(logits.float(), labels)
        self.log("val/loss", loss, sync_dist=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if self._pipeline_val:  # pp: the logits stay on the last stage; the mean loss gives the perplexity
            self.log("val/perplexity", torch.stack(self._pipeline_val).mean().exp(), sync_dist=True)
            self._pipeline_val.clear()
        else:
            self.log("val/perplexity", self.val_perplexity.compute(), sync_dist=False)
        self.val_perplexity.reset()
        if self.routed_experts:
            # Validation runs between optimizer steps, where the counts start at zero: the tokens it routed are not
            # training load and must not move the bias.
            moe_load.reset_counts(self.model)

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


class _VocabParallel:
    """torch's `loss_parallel`, re-entrant: a pipeline runs the loss (which enters it) inside the schedule's step
    (which must hold it for the backward), and leaving torch's context removes its handlers whatever the depth."""

    depth = 0

    def __enter__(self) -> None:
        if _VocabParallel.depth == 0:
            self._context = loss_parallel()
            self._context.__enter__()
        _VocabParallel.depth += 1

    def __exit__(self, *exc) -> None:
        _VocabParallel.depth -= 1
        if _VocabParallel.depth == 0:
            self._context.__exit__(*exc)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy; logits split over the vocabulary (a DTensor, tp > 1) are never gathered whole."""
    flat = logits.flatten(0, 1).float()
    if isinstance(logits, DTensor):
        with _VocabParallel():
            # The mean comes out replicated: its local value is the loss on every tp rank, a plain tensor for
            # whatever sums and logs it (backward still runs through the DTensor ops).
            return F.cross_entropy(flat, labels.flatten()).to_local()
    return F.cross_entropy(flat, labels.flatten())


def _pp_size(strategy) -> int:
    pcfg = getattr(strategy, "parallel_config", None)
    return pcfg.pp if isinstance(pcfg, ParallelConfig) else 1


def _tp_size(strategy) -> int:
    pcfg = getattr(strategy, "parallel_config", None)
    if isinstance(pcfg, ParallelConfig):
        return pcfg.tp
    mesh = getattr(strategy, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1


def _layout(mesh, strategy) -> ParallelConfig:
    """The layout of ``mesh``: the strategy's when it names one (dynatrain's, whose mesh may have ep's four
    dimensions), else read from Lightning ModelParallelStrategy's mesh or a plain (dp_replicate, dp_shard, tp)
    mesh."""
    pcfg = getattr(strategy, "parallel_config", None)
    if isinstance(pcfg, ParallelConfig):
        return pcfg
    names = mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and "data_parallel" in names:
        return ParallelConfig(dp_shard=mesh["data_parallel"].size(), tp=mesh["tensor_parallel"].size())
    if "tp" in names:
        return ParallelConfig(*mesh.shape)
    raise ValueError(
        f"CausalLM needs a device mesh with dims ('data_parallel', 'tensor_parallel') or (dp_replicate, dp_shard, tp);"
        f" got {names}"
    )


# The name the dense-only module had; recipes, checkpoints' hyperparameters and user code keep working.
LlamaLM = CausalLM
