"""One rank of the step-time benchmark: LlamaLM under a given strategy, writes its optimizer-step times."""

import argparse
import os
import time
import warnings

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy

import dynatrain
from dynatrain.launcher import finish_rank
from dynatrain.data import LlamaDataModule
from dynatrain.llama_lm import LlamaLM

warnings.filterwarnings("ignore")


class StepClock(pl.Callback):
    def __init__(self):
        self.times: list[float] = []
        self._step = 0

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.times.append(time.perf_counter())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", choices=["dynatrain", "lightning"], required=True)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    dp = world // args.tp
    if args.strategy == "lightning":
        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=args.tp)
    else:
        strategy = dynatrain.DynaTrainStrategy(parallel=f"dp_shard={dp},tp={args.tp}")
    clock = StepClock()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                         callbacks=[clock])
    data = LlamaDataModule(seq_len=args.seq_len, global_batch_size=args.micro_batch * dp,
                           micro_batch_size=args.micro_batch, max_corpus_bytes=2_000_000)
    trainer.fit(LlamaLM(model=args.model, warmup_steps=2), datamodule=data)
    result = {"step_times": [b - a for a, b in zip(clock.times, clock.times[1:])]}
    del trainer, strategy
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
