"""A LightningModule written the way Lightning's ModelParallelStrategy documentation teaches, with nothing written
for dynatrain: its own small transformer (embeddings, LayerNorm with bias, biased linears, buffers, attention and an
MLP), parallelised in an idempotent configure_model() with FSDP2 and DTensor tensor parallelism."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 32, heads: int = 4, hidden: int = 72, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        # A persistent buffer the training loop changes, and a non-persistent one: both must survive a switch.
        self.register_buffer("logit_scale", torch.tensor(1.0))  # 0-d
        self.register_buffer("positions_seen", torch.zeros(1, dtype=torch.int64), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) * self.logit_scale


def parallelize(model: TinyLM, tp_mesh, dp_mesh) -> None:
    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
        for block in model.blocks:
            parallelize_module(block, tp_mesh, {
                "ln1": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                "ln2": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.up": ColwiseParallel(),
                "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
            })
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


class RowScaled(torch.optim.Optimizer):
    """SGD scaled by a per-row running mean of squared gradients: state of another shape than its parameter (as
    a factored optimizer keeps), which a switch must refuse."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        with torch.no_grad():
            self._update()

    def _update(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.dim() == 2:
                        self.state[p].setdefault("row", torch.zeros(p.shape[0])).add_(1.0)
                    p.add_(p.grad, alpha=-group["lr"])


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "amsgrad": lambda params: torch.optim.Adam(params, lr=3e-3, amsgrad=True),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),  # factored state: cannot be switched
    "rowscaled": RowScaled,
}


class _StepLoss(pl.LightningModule):
    """The language-modelling loss of a micro-batch, and each step's loss over the whole global batch."""

    def __init__(self) -> None:
        super().__init__()
        self.step_losses: list[float] = []
        self._micro: list[torch.Tensor] = []

    def _lm_loss(self, batch) -> torch.Tensor:
        tokens, labels = batch
        loss = F.cross_entropy(self.net(tokens).flatten(0, 1), labels.flatten())
        self._micro.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        loss = torch.stack(self._micro).mean()
        torch.distributed.all_reduce(loss)
        self.step_losses.append(loss.item() / torch.distributed.get_world_size())
        self._micro.clear()


class UserLM(_StepLoss):
    """``build_in="init"``: the model is made in __init__; ``"configure"``: in configure_model (guarded)."""

    def __init__(self, optimizer: str = "adamw", build_in: str = "init", heads: int = 4) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.heads = heads
        self.net = TinyLM(heads=heads) if build_in == "init" else None

    def configure_model(self) -> None:
        tp = self.device_mesh["tensor_parallel"].size()
        if self.heads % tp:
            raise ValueError(f"tp={tp} does not divide the {self.heads} attention heads")
        if self.net is None:
            self.net = TinyLM(heads=self.heads)
        elif any(hasattr(m, "reshard") for m in self.net.modules()):
            return  # already parallelised: Lightning asks this hook to be idempotent
        parallelize(self.net, self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        return self._lm_loss(batch)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        with torch.no_grad():
            self.net.positions_seen += batch[0].numel()
            if self.trainer.fit_loop.epoch_loop._accumulated_batches_reached():
                self.net.logit_scale.mul_(0.97)

    def configure_optimizers(self):
        opt = OPTIMIZERS[self.optimizer_name](self.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class MoELM(_StepLoss):
    """A LightningModule around the zoo's mixture-of-experts decoder, parallelised with its own parallelize_fn in
    configure_model(); the router's balancing state (expert bias, token counts) lives in buffers."""

    def __init__(self, optimizer: str = "adamw", n_experts: int = 8) -> None:
        super().__init__()
        from dynatrain.models.moe import MoETransformer
        from dynatrain.models.moe_configs import MOE_CONFIGS

        self.optimizer_name = optimizer
        self.net = MoETransformer(MOE_CONFIGS["moe-debug"].with_overrides(bias_update_rate=1e-2, n_experts=n_experts))
        self.net.init_weights()

    def configure_model(self) -> None:
        from dynatrain.models.parallelize_moe import parallelize_moe

        if not any(hasattr(m, "reshard") for m in self.net.modules()):
            # During a switch this hook runs for the target: the strategy's parallel_config is the target's then.
            parallelize_moe(self.net, self.device_mesh, self.trainer.strategy.parallel_config)

    def training_step(self, batch, batch_idx):
        return self._lm_loss(batch) + self.net.aux_loss()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.trainer.fit_loop.epoch_loop._accumulated_batches_reached():
            for block in self.net.layers.values():
                counts = block.moe.tokens_per_expert.clone()
                torch.distributed.all_reduce(counts)  # every rank moves the bias by the job's load
                block.moe.update_expert_bias(counts)

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer_name](self.parameters())
