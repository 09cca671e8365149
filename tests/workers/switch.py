"""One rank of a training run that switches layouts at given steps; writes losses and switch reports."""

import argparse
import gc
import json
import os
import resource
import warnings

import lightning.pytorch as pl
import torch.distributed as dist

import dynatrain
from dynatrain.data import LlamaDataModule
from dynatrain.llama_lm import LlamaLM

warnings.filterwarnings("ignore")


class Script(pl.Callback):
    """Request layout ``layouts[i]`` when step ``steps[i]`` has finished."""

    def __init__(self, plan: list[tuple[int, str]]):
        self.plan = dict(plan)
        self.rss = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step in self.plan:
            trainer.strategy.request_switch(self.plan.pop(step))
            self.rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--switches", default="", help="step:layout;step:layout")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--budget-mb", type=float, default=0.25)
    ap.add_argument("--n-layers", type=int, default=2)
    args = ap.parse_args()
    plan = [(int(s.split(":")[0]), s.split(":", 1)[1]) for s in args.switches.split(";") if s]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel=args.layout, verify_switches=True,
                                           switch_budget_mb=args.budget_mb)
    script = Script(plan)
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
        "rss_kb": script.rss,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    del trainer, module, strategy
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
