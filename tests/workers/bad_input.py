"""One rank of a 2-process run that makes bad switch requests at an optimizer-step boundary.

Every bad request must raise ValueError and leave every weight, Adam state, the layout, the mesh, gradient
accumulation and the data position exactly as they were; training then runs to ``--steps`` on the same layout.
The model has 3 attention heads, so tp=2 cannot divide it.
"""

import argparse
import math
import warnings
from dataclasses import replace

import lightning.pytorch as pl
import torch

import dynatrain
from dynatrain.data import LlamaDataModule
from dynatrain.launch.local import finish_rank
from dynatrain.lm.causal_lm import LlamaLM

warnings.filterwarnings("ignore")

MODEL = {"n_layers": 1, "dim": 192, "n_heads": 3, "n_kv_heads": 1, "ffn_dim": 512}
# (what, call) pairs; each call takes the strategy and must raise ValueError.
BAD = [
    ("tp_heads", lambda s: s.request_switch("tp=2")),
    ("product", lambda s: s.request_switch("dp_shard=4")),
    ("product_tp", lambda s: s.request_switch("dp_shard=2,tp=2")),
    ("parse", lambda s: s.request_switch("dp=2")),
    ("zero", lambda s: s.request_switch("tp=0")),
    ("leave", lambda s: s.request_switch("dp_shard=2", leave=[5])),
    ("pp_layers", lambda s: s.request_switch("pp=2")),
    # 6 bytes: half stages a round, less than one 4-byte element; refused before any state moves.
    ("budget", lambda s: s.switch("dp_replicate=2", budget_mb=6 / 2**20)),
]


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(trainer, module) -> dict:
    """Clones of this rank's local weights and optimizer state, and everything a switch would change."""
    optimizer = trainer.optimizers[0]
    tensors = {}
    for name, p in module.model.named_parameters():
        tensors[name] = local(p.detach()).clone()
        for key, value in optimizer.state[p].items():
            tensors[f"{name}.{key}"] = local(value).clone() if isinstance(value, torch.Tensor) else value
    strategy, data = trainer.strategy, trainer.datamodule
    return {
        "tensors": tensors,
        "params": [id(p) for p in module.model.parameters()],
        "optimizer": id(optimizer),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict() if trainer.lr_scheduler_configs else None,
        "layout": strategy.parallel_config.short(),
        "positions": list(strategy.positions),
        "mesh": id(strategy.device_mesh),
        "accumulation": trainer.accumulate_grad_batches,
        "offset": strategy._switcher.accumulation_offset,
        "data": (data.dp_size, data.dp_rank, data.consumed_samples),
        "pending": strategy.switch_pending,
    }


def differences(before: dict, after: dict) -> list[str]:
    out = [k for k in before if k != "tensors" and before[k] != after[k]]
    a, b = before["tensors"], after["tensors"]
    if a.keys() != b.keys():
        return [*out, "tensor names"]
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor):
            same = (x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
        else:
            same = x == y
        if not same:
            out.append(name)
    return out


class BadRequests(pl.Callback):
    def __init__(self, at_step: int):
        self.at_step = at_step
        self.errors: dict[str, str] = {}
        self.not_refused: list[str] = []
        self.changed: list[str] | None = None
        self.states = 0
        self.before: dict | None = None
        self.changed_by_refused_plan: list[str] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        if trainer.global_step != self.at_step or self.changed is not None or not strategy.at_step_boundary():
            return
        before = snapshot(trainer, pl_module)
        self.states = len(before["tensors"])
        for what, call in BAD:
            try:
                call(strategy)
            except ValueError as e:
                self.errors[what] = str(e)
            else:
                self.not_refused.append(what)
        self.changed = differences(before, snapshot(trainer, pl_module))
        # A strategy-wide budget below the minimum passes the request's checks and fails when the switch is
        # planned at this boundary: refused with a warning there, nothing moved, training goes on.
        strategy.switching = replace(strategy.switching, switch_budget_mb=6 / 2**20)  # 6 bytes
        strategy.request_switch("dp_replicate=2")
        self.before = before

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.before is not None:
            self.changed_by_refused_plan = differences(self.before, snapshot(trainer, pl_module))
            self.before = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--bad-at", type=int, default=2)
    args = ap.parse_args()
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel="dp_shard=2")
    bad = BadRequests(args.bad_at)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[bad],
    )
    module = LlamaLM(model="debug", model_overrides=MODEL, lr=1e-3, warmup_steps=2)
    data = LlamaDataModule(seq_len=32, global_batch_size=4, micro_batch_size=1, max_corpus_bytes=200_000)
    trainer.fit(module, datamodule=data)
    result = {
        "errors": bad.errors,
        "not_refused": bad.not_refused,
        "changed": bad.changed,
        "changed_by_refused_plan": bad.changed_by_refused_plan,
        "states": bad.states,
        "losses": module.step_losses,
        "finite": all(math.isfinite(x) for x in module.step_losses),
        "layout": strategy.parallel_config.short(),
        "reports": len(strategy.switch_reports),
        "global_step": trainer.global_step,
        "accumulation": trainer.accumulate_grad_batches,
        "consumed_samples": data.consumed_samples,
    }
    del trainer, module, strategy
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
