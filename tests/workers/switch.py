"""One rank of a training run that switches layouts at given steps; writes losses and switch reports."""

import argparse
import os
import warnings

import lightning.pytorch as pl

import dynatrain
from dynatrain.launch.local import finish_rank
from dynatrain.data import LlamaDataModule
from dynatrain.lm.causal_lm import LlamaLM

warnings.filterwarnings("ignore")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Script(pl.Callback):
    """Request layout ``layouts[i]`` at the first micro-batch after step ``steps[i]`` (with gradient
    accumulation that is mid-step: the strategy must wait for the boundary), ``layout:ahead`` with
    ``plan_ahead=True``. Bad requests must raise."""

    def __init__(self, plan: list[tuple[int, str]], bad: list[tuple[int, str]]):
        self.plan = dict(plan)
        self.bad = list(bad)
        self.errors: list[str] = []
        self.requested_at: list[tuple[int, int]] = []
        self.rss: list[int] = []
        self.fds: list[int] = []
        self.threads: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        for when, layout in [b for b in self.bad if b[0] == step]:
            self.bad.remove((when, layout))
            try:
                trainer.strategy.request_switch(layout)
            except ValueError as e:
                self.errors.append(str(e))
        if step in self.plan:
            layout, _, ahead = self.plan.pop(step).partition(":")
            trainer.strategy.request_switch(layout, plan_ahead=ahead == "ahead")
            self.requested_at.append((step, batch_idx))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if len(trainer.strategy.switch_reports) > len(self.rss):
            self.rss.append(rss_bytes())
            self.fds.append(len(os.listdir("/proc/self/fd")))
            self.threads.append(len(os.listdir("/proc/self/task")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--switches", default="", help="step:layout[:ahead];step:layout")
    ap.add_argument("--bad", default="", help="step:layout;... requests that must be refused")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--budget-mb", type=float, default=0.25)
    ap.add_argument("--n-layers", type=int, default=2)
    args = ap.parse_args()
    def parse(text):
        return [(int(s.split(":")[0]), s.split(":", 1)[1]) for s in text.split(";") if s]

    plan, bad = parse(args.switches), parse(args.bad)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel=args.layout,
                                           switching={"verify_switches": True, "switch_budget_mb": args.budget_mb})
    script = Script(plan, bad)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[script],
    )
    module = LlamaLM(model="debug", model_overrides={"n_layers": args.n_layers}, lr=1e-3, warmup_steps=2)
    data = LlamaDataModule(seq_len=64, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
                           max_corpus_bytes=400_000)
    trainer.fit(module, datamodule=data)
    result = {
        "losses": module.step_losses,
        "layout": strategy.parallel_config.short(),
        "reports": [r.as_dict() for r in strategy.switch_reports],
        "accumulation": trainer.accumulate_grad_batches,
        "global_step": trainer.global_step,
        "consumed_samples": data.consumed_samples,
        "rss": script.rss,
        "fds": script.fds,
        "threads": script.threads,
        "errors": script.errors,
        "requested_at": script.requested_at,
    }
    del trainer, module, strategy
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
