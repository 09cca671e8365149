"""One rank of several short runs in one process, each a fresh Trainer with the strategy's activation checkpointing
and compile options (and optionally layout switches); writes every run's losses, reports and what its blocks are."""

import argparse
import json
import os
import warnings

import lightning.pytorch as pl
import torch

import dynatrain
from dynatrain.data import LlamaDataModule
from dynatrain.launch.local import finish_rank
from dynatrain.lm.causal_lm import LlamaLM
from dynatrain.models.checkpointing import is_checkpointed
from dynatrain.models.compile import compile_seconds, is_compiled

warnings.filterwarnings("ignore")


class Switches(pl.Callback):
    def __init__(self, plan: dict[int, str]):
        self.plan = dict(plan)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        layout = self.plan.pop(trainer.global_step, None)
        if layout is not None:
            trainer.strategy.request_switch(layout)


def run(spec: dict, world: int, steps: int) -> dict:
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(
        parallel=spec.get("layout", "dp_shard=2"), switching={"verify_switches": True},
        parallelism={"activation_checkpointing": spec.get("ac", "none"), "compile": spec.get("compile", False)})
    plan = {int(k): v for k, v in spec.get("switches", {}).items()}
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[Switches(plan)],
    )
    module = LlamaLM(model=spec.get("model", "debug"), model_overrides={"n_layers": 2}, lr=1e-3, warmup_steps=2)
    data = LlamaDataModule(seq_len=64, global_batch_size=8, micro_batch_size=2, max_corpus_bytes=400_000)
    trainer.fit(module, datamodule=data)
    blocks = module.model.layers
    result = {
        "losses": module.step_losses,
        "layout": strategy.parallel_config.short(),
        "reports": [r.as_dict() for r in strategy.switch_reports],
        "checkpointed": [k for k, b in blocks.items() if is_checkpointed(b)],
        "compiled": [k for k, b in blocks.items() if is_compiled(b)],
        "names": [n for n, _ in module.named_parameters()],
        "compile_s_total": compile_seconds(),
        "graphs": dict(torch._dynamo.utils.counters["stats"]),
    }
    del trainer, module, strategy
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", required=True, help="JSON: {name: {ac, compile, layout, switches, model}}")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {name: run(spec, world, args.steps) for name, spec in json.loads(args.runs).items()}
    finish_rank(args.out, results)


if __name__ == "__main__":
    main()
