"""One rank of `dynatrain selfcheck`: train, switch at the given steps, compare each switch with the oracle."""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch.nn.functional as F

import dynatrain
from dynatrain.launcher import finish_rank
from dynatrain.data import LlamaDataModule
from dynatrain.llama_lm import LlamaLM
from dynatrain.selfcheck import oracle


class ScriptedSwitches(pl.Callback):
    def __init__(self, layouts: list[str], steps_between: int, workdir: Path, check: bool):
        self.layouts = layouts[1:]
        self.steps_between = steps_between
        self.workdir = workdir
        self.check = check
        self.results: list[dict] = []
        self.shadow = None  # the oracle's model and optimizer, trained on the same micro-batches for one step

    def _shadow_micro_batch(self, trainer, pl_module, batch) -> None:
        model, optimizer, left = self.shadow
        tokens, labels = batch
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
        (loss / trainer.accumulate_grad_batches).backward()
        left -= 1
        self.shadow = (model, optimizer, left)
        if left:
            return
        optimizer.step()
        self.results[-1]["step_after_equal"] = oracle.bitwise_equal(
            pl_module.model, trainer.strategy.optimizers[0], model, optimizer, trainer.strategy.root_device)
        self.shadow = None
        gc.collect()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.shadow is not None:
            self._shadow_micro_batch(trainer, pl_module, batch)
        strategy = trainer.strategy
        step = trainer.global_step
        done = len(self.results)
        if done >= len(self.layouts) or step != (done + 1) * self.steps_between:
            return
        if not strategy._switcher.at_boundary():
            return
        ckpt = self.workdir / f"before-switch-{done}"
        if self.check:
            oracle.save(pl_module.model, strategy.optimizers[0], ckpt)
        report = strategy.switch(self.layouts[done])
        equal = None
        if self.check:
            model, optimizer = oracle.load_into_layout(strategy, pl_module, ckpt)
            equal = oracle.bitwise_equal(pl_module.model, strategy.optimizers[0], model, optimizer,
                                         strategy.root_device)
            if step < trainer.max_steps:
                self.shadow = (model, optimizer, trainer.accumulate_grad_batches)
            del model, optimizer
        self.results.append({
            "from": report.old_layout, "to": report.new_layout, "step": step, "bitwise_equal": equal,
            "step_after_equal": None,
            "bytes_moved": report.bytes_moved, "bytes_moved_identity": report.bytes_moved_identity,
            "bytes_total": report.bytes_total, "seconds": report.stall_s, "phases": report.phases,
            "peak_bytes": report.peak_bytes, "peak_bound": report.peak_bound,
        })


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--layouts", required=True, help="layouts separated by '>'")
    ap.add_argument("--steps-between", type=int, default=2)
    ap.add_argument("--static", action="store_true", help="train the same steps on the first layout only")
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--budget-mb", type=float, default=64.0)
    ap.add_argument("--n-layers", type=int, default=None)
    ap.add_argument("--workdir", required=True, help="a folder every rank sees: the oracle's DCP checkpoints")
    args = ap.parse_args()
    layouts = [s.strip() for s in args.layouts.split(">")]
    steps = args.steps_between * len(layouts)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pl.seed_everything(1234, verbose=False)
    workdir = Path(args.workdir) / ("static" if args.static else "switching")
    strategy = dynatrain.DynaTrainStrategy(parallel=layouts[0], switch_budget_mb=args.budget_mb,
                                           verify_switches=False)
    script = ScriptedSwitches([] if args.static else layouts, args.steps_between, workdir, check=True)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                         callbacks=[script])
    overrides = {"n_layers": args.n_layers} if args.n_layers else None
    module = LlamaLM(model=args.model, model_overrides=overrides, lr=1e-3, warmup_steps=2)
    data = LlamaDataModule(seq_len=args.seq_len, global_batch_size=args.global_batch,
                           micro_batch_size=args.micro_batch, max_corpus_bytes=1_000_000)
    trainer.fit(module, datamodule=data)
    result = {"losses": module.step_losses, "switches": script.results}
    del trainer, module, strategy
    finish_rank(args.out, result)
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
