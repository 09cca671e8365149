"""A zoo model trained under stock torchrun, for bench/launchers.py: the user's view, `strategy="dynatrain"` and no
line for elasticity (the dynatrain rendezvous backend, when it runs it, adds the callback).

Rank 0 appends the end of every optimizer step (``time.time()``, the world size) to ``--out/marks.jsonl`` and reads
``--out/control.json`` at every step, which every rank then follows: ``sleep`` seconds per step, ``stop_at`` (the
last step), ``save_at`` (a step after which every rank saves a checkpoint to ``--out/ckpt`` for a restart).
"""

import argparse
import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl

import dynatrain
from dynatrain.data import LlamaDataModule
from dynatrain.lm.causal_lm import CausalLM


class Marks(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        if getattr(strategy, "detached", False) or not strategy.at_step_boundary():
            return
        step, rank = trainer.global_step, trainer.global_rank
        control = None
        if rank == 0:
            with open(self.out / "marks.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "t": time.time(), "world": trainer.world_size}) + "\n")
            path = self.out / "control.json"
            control = json.loads(path.read_text()) if path.exists() else {}
        control = strategy.broadcast(control)
        if control.get("save_at") == step:
            trainer.save_checkpoint(self.out / "ckpt")
            if rank == 0:
                (self.out / "saved").write_text(str(step))
        if control.get("stop_at") is not None and step >= control["stop_at"]:
            trainer.should_stop = True
        time.sleep(float(control.get("sleep", 0)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="125m")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    pl.seed_everything(1234, verbose=False)
    trainer = pl.Trainer(strategy=dynatrain.DynaTrainStrategy(), accelerator="cpu",
                         devices=int(os.environ["LOCAL_WORLD_SIZE"]), max_steps=100_000, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(args.out), use_distributed_sampler=False, callbacks=[Marks(args.out)])
    data = LlamaDataModule(seq_len=args.seq_len, global_batch_size=args.global_batch,
                           micro_batch_size=args.micro_batch, max_corpus_bytes=2_000_000)
    trainer.fit(CausalLM(model=args.model), datamodule=data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
