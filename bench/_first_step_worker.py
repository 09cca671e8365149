"""One process of `bench/first_step.py`: a fixed world that switches along ``--chain`` every ``--every`` steps.

Writes per optimizer step the time from its first micro-batch to its end; with ``--profile``, rank 0 also profiles
the first step after each switch and the step ``--steady-offset`` steps later (same layout, warm) and writes each
operator's self CPU time for both.
"""

import argparse
import time
import warnings

import lightning.pytorch as pl
import torch

import dynatrain
from dynatrain.data import LlamaDataModule
from dynatrain.launch.local import finish_rank
from dynatrain.lm.causal_lm import LlamaLM
from _trainer import bench_trainer  # this folder

warnings.filterwarnings("ignore")


class FirstSteps(pl.Callback):
    def __init__(self, args) -> None:
        self.args, self.targets = args, args.chain.split(",")[1:]
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}
        self.switched_after: list[int] = []
        self.profiles: dict[int, dict[str, float]] = {}
        self._prof = None

    def profiled_steps(self) -> set[int]:
        a = self.args
        firsts = [a.every * (i + 1) + 1 for i in range(len(self.targets))]
        return set(firsts) | {f + a.steady_offset for f in firsts}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step + 1
        if step in self.starts:
            return
        if self.args.profile and trainer.global_rank == 0 and step in self.profiled_steps():
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._prof.__enter__()
        self.starts[step] = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step not in self.starts or step in self.ends:
            return
        self.ends[step] = time.time()
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self.profiles[step] = {e.key: e.self_cpu_time_total / 1e6 for e in self._prof.key_averages()}
            self._prof = None
        i = step // self.args.every - 1
        if step % self.args.every == 0 and 0 <= i < len(self.targets):
            self.switched_after.append(step)
            trainer.strategy.request_switch(self.targets[i])
        if step >= self.args.every * (len(self.targets) + 1):
            trainer.should_stop = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--chain", required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--steady-offset", type=int, required=True)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--model", default="debug")
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    pl.seed_everything(1234, verbose=False)
    clock = FirstSteps(args)
    strategy = dynatrain.DynaTrainStrategy(parallel=args.chain.split(",")[0], switching={"verify_switches": False})
    trainer = bench_trainer(strategy, 2, 10_000, [clock])
    data = LlamaDataModule(seq_len=args.seq_len, global_batch_size=4, micro_batch_size=1, max_corpus_bytes=1_000_000)
    trainer.fit(LlamaLM(model=args.model, lr=1e-3, warmup_steps=2, total_steps=100), datamodule=data)
    finish_rank(args.out, {"spans": {s: clock.ends[s] - clock.starts[s] for s in clock.ends},
                           "switched_after": clock.switched_after,
                           "stall_s": [r.stall_s for r in strategy.switch_reports],
                           "profiles": {str(s): p for s, p in clock.profiles.items()}})


if __name__ == "__main__":
    main()
