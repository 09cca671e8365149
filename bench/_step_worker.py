"""One rank of the step-time benchmark: LlamaLM under a given strategy, or the hand-written FSDP2 loop of
`_fsdp_loop.py`; writes its optimizer-step times."""

import argparse
import os
import resource
import time
import warnings

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy

import dynatrain
from dynatrain.launch.local import finish_rank
from dynatrain.data import LlamaDataModule
from dynatrain.lm.causal_lm import LlamaLM
from _trainer import bench_trainer  # this folder

warnings.filterwarnings("ignore")


class StepClock(pl.Callback):
    """At the end of each optimizer step: the wall clock, and this process's CPU seconds (user, system) and minor
    page faults so far."""

    def __init__(self):
        self.times: list[float] = []
        self.usage: list[tuple[float, float, int]] = []
        self._step = 0

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.times.append(time.perf_counter())
            ru = resource.getrusage(resource.RUSAGE_SELF)
            self.usage.append((ru.ru_utime, ru.ru_stime, ru.ru_minflt))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", choices=["dynatrain", "lightning", "fsdp-loop"], required=True)
    ap.add_argument("--compile", default=None, help="torch.compile backend per block (dynatrain and fsdp-loop)")
    ap.add_argument("--every", type=int, default=0,
                    help="checkpoint every n-th block (selective:n; 1 = full; dynatrain and fsdp-loop)")
    ap.add_argument("--model", default="debug")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    dp = world // args.tp
    if args.strategy == "fsdp-loop":
        import torch.distributed as dist

        from _fsdp_loop import run_loop

        if args.tp != 1:
            raise SystemExit("the hand-written loop is pure FSDP: --tp 1")
        dist.init_process_group("gloo")
        times = run_loop(args.model, args.steps, args.seq_len, args.micro_batch, args.every, args.compile)
        dist.barrier()
        finish_rank(args.out, {"step_times": times[1:]})  # as the callback's: from the end of the first step
        return
    if args.strategy == "lightning":
        if args.compile or args.every:
            raise SystemExit("ModelParallelStrategy runs the model as LlamaLM parallelises it: no --compile/--every")
        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=args.tp)
    else:
        ac = "none" if not args.every else "full" if args.every == 1 else f"selective:{args.every}"
        strategy = dynatrain.DynaTrainStrategy(
            parallel=f"dp_shard={dp},tp={args.tp}",
            parallelism={"compile": args.compile or False, "activation_checkpointing": ac})
    clock = StepClock()
    trainer = bench_trainer(strategy, world, args.steps, [clock])
    data = LlamaDataModule(seq_len=args.seq_len, global_batch_size=args.micro_batch * dp,
                           micro_batch_size=args.micro_batch, max_corpus_bytes=2_000_000)
    trainer.fit(LlamaLM(model=args.model, warmup_steps=2), datamodule=data)
    u = clock.usage
    result = {"step_times": [b - a for a, b in zip(clock.times, clock.times[1:])],
              "step_user_s": [b[0] - a[0] for a, b in zip(u, u[1:])],
              "step_system_s": [b[1] - a[1] for a, b in zip(u, u[1:])],
              "step_minor_faults": [b[2] - a[2] for a, b in zip(u, u[1:])],
              "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    del trainer, strategy
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
