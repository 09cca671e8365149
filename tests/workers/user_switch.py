"""One rank of UserLM trained under strategy="dynatrain", switching layouts at given steps."""

import argparse
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

import dynatrain
from dynatrain.data import LlamaDataModule
from dynatrain.launch.local import finish_rank

sys.path.insert(0, str(Path(__file__).parent))
from user_model import MoELM, UserLM  # noqa: E402

warnings.filterwarnings("ignore")


class Script(pl.Callback):
    def __init__(self, plan: dict[int, str], bad: list[tuple[int, str]]):
        self.plan, self.bad, self.errors, self.untouched = plan, bad, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        for when, layout in [b for b in self.bad if b[0] == step]:
            self.bad.remove((when, layout))
            before = _snapshot(trainer)
            try:
                trainer.strategy.request_switch(layout)
            except ValueError as e:
                self.errors.append(str(e))
            self.untouched.append(before == _snapshot(trainer))
        if step in self.plan:
            trainer.strategy.request_switch(self.plan.pop(step))


def _snapshot(trainer) -> list:
    """Every local weight, optimizer tensor and buffer, as bytes."""
    module, opt = trainer.lightning_module, trainer.strategy.optimizers[0]
    out = []
    for t in [*module.parameters(), *module.buffers(), *(v for st in opt.state.values() for v in st.values())]:
        if hasattr(t, "to_local"):
            t = t.to_local()
        out.append(t.detach().clone().contiguous().view(-1).view(torch.uint8).tolist()
                   if t.numel() else [])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--switches", default="")
    ap.add_argument("--bad", default="")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--build-in", default="init")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--moe", action="store_true", help="train MoELM (the zoo's MoE decoder) instead of UserLM")
    ap.add_argument("--experts", type=int, default=8, help="routed experts of MoELM")
    ap.add_argument("--corpus-bytes", type=int, default=200_000, help="of the embedded corpus (fewer: short epochs)")
    args = ap.parse_args()
    parse = lambda text: [(int(s.split(":")[0]), s.split(":", 1)[1]) for s in text.split(";") if s]  # noqa: E731
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel=args.layout,
                                           switching={"verify_switches": True, "switch_budget_mb": 0.25})
    script = Script(dict(parse(args.switches)), parse(args.bad))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")), max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[script],
    )
    module = MoELM(args.optimizer, args.experts) if args.moe else UserLM(args.optimizer, args.build_in, args.heads)
    data = LlamaDataModule(seq_len=32, global_batch_size=8, micro_batch_size=2, max_corpus_bytes=args.corpus_bytes)
    trainer.fit(module, datamodule=data)
    opt = strategy.optimizers[0]
    if args.moe:
        net = module.net
        extra = {"expert_bias": [b.moe.expert_bias.tolist() for b in net.layers.values()]}
    else:
        extra = {"logit_scale": module.net.logit_scale.item(), "positions_seen": int(module.net.positions_seen.item())}
    result = {
        "losses": module.step_losses,
        "layout": strategy.parallel_config.short(),
        "reports": [r.as_dict() for r in strategy.switch_reports],
        "errors": script.errors,
        "untouched": script.untouched,
        **extra,
        "lr": opt.param_groups[0]["lr"],
        "state_keys": sorted({k for st in opt.state.values() for k in st}),
    }
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
