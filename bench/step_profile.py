"""Why two strategies' step times differ: wall and CPU seconds per step, and torch.profiler's top operators.

    python bench/step_profile.py [--model debug] [--devices 2] [--steps 12] [--repeats 2] [--json out.json]

The same runs as `bench/step_time.py` (alternating dynatrain / ModelParallelStrategy, same model and layout), but
each rank records its process CPU time per step next to the wall time, and rank 0 profiles its last 4 steps with
torch.profiler (CPU operators, self time). On a shared machine the wall time includes waiting for the cores; the CPU
time is the work the process did, so a difference in CPU per step is a difference in work, and a difference in wall
time at equal CPU is waiting. This file is also the rank script (with ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------- one rank
def rank_main(args) -> None:
    import os
    import warnings

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    import dynatrain
    from dynatrain.data import LlamaDataModule
    from dynatrain.launch.local import finish_rank
    from dynatrain.lm.causal_lm import LlamaLM
    from _trainer import bench_trainer  # this folder

    warnings.filterwarnings("ignore")

    class StepMeter(pl.Callback):
        """Wall and CPU time per optimizer step; rank 0 profiles the steps from ``first`` on."""

        def __init__(self, first: int, last: int) -> None:
            self.first, self.last = first, last
            self.steps: list[dict] = []
            self.prof = None
            self._mark = None
            self._seen = 0

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == self._seen:
                return
            self._seen = trainer.global_step
            now = (time.perf_counter(), time.process_time())
            if self._mark is not None:
                self.steps.append({"step": self._seen, "wall": now[0] - self._mark[0], "cpu": now[1] - self._mark[1]})
            self._mark = now
            if trainer.global_rank == 0 and self._seen == self.first:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()
            if self.prof is not None and self._seen == self.last:
                self.prof.__exit__(None, None, None)

    world = int(os.environ["WORLD_SIZE"])
    if args.strategy == "lightning":
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = dynatrain.DynaTrainStrategy(parallel=f"dp_shard={world}")
    meter = StepMeter(first=args.steps - 5, last=args.steps - 1)
    trainer = bench_trainer(strategy, world, args.steps, [meter])
    data = LlamaDataModule(seq_len=args.seq_len, global_batch_size=args.micro_batch * world,
                           micro_batch_size=args.micro_batch, max_corpus_bytes=2_000_000)
    trainer.fit(LlamaLM(model=args.model, warmup_steps=2), datamodule=data)
    top = []
    if meter.prof is not None:
        avgs = sorted(meter.prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
        top = [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in avgs]
    profiled = max(1, meter.last - meter.first)
    result = {"steps": meter.steps, "top_ops": top, "profiled_steps": profiled, "profile_from": meter.first}
    del trainer, strategy
    finish_rank(args.out, result)


# ---------------------------------------------------------------------------------------------- the driver
def summarise(runs: dict[str, list[list[dict]]]) -> dict:
    out = {}
    for name, reps in runs.items():
        # Steps 1-3 warm up; profiled steps carry the profiler's overhead: neither is timed.
        steps = [s for ranks in reps for r in ranks for s in r["steps"] if 3 < s["step"] <= r["profile_from"]]
        ops: dict[str, float] = {}
        for ranks in reps:
            for o in ranks[0]["top_ops"]:
                ops[o["op"]] = ops.get(o["op"], 0.0) + o["self_cpu_ms"] / ranks[0]["profiled_steps"] / len(reps)
        out[name] = {"wall_s": statistics.median(s["wall"] for s in steps),
                     "cpu_s": statistics.median(s["cpu"] for s in steps), "steps": len(steps),
                     "top_ops_ms_per_step": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}
    return out


def table(summary: dict) -> str:
    names = list(summary)
    a, b = (summary[n] for n in names)
    out = [f"| | {names[0]} | {names[1]} | ratio |", "|---|---|---|---|",
           f"| median wall s per step | {a['wall_s']:.4f} | {b['wall_s']:.4f} | {a['wall_s'] / b['wall_s']:.3f} |",
           f"| median CPU s per step (per process) | {a['cpu_s']:.4f} | {b['cpu_s']:.4f} "
           f"| {a['cpu_s'] / b['cpu_s']:.3f} |"]
    ops = list(dict.fromkeys([*a["top_ops_ms_per_step"], *b["top_ops_ms_per_step"]]))[:12]
    out += ["", f"| operator (rank 0, self CPU ms per step) | {names[0]} | {names[1]} |", "|---|---|---|"]
    for op in ops:
        cells = [f"{x['top_ops_ms_per_step'].get(op, 0):.1f}" for x in (a, b)]
        out.append(f"| `{op}` | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--strategy", choices=["dynatrain", "lightning"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.out:
        rank_main(args)
        return 0
    from dynatrain.launch.local import launch_local

    runs: dict[str, list] = {"dynatrain": [], "lightning": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name in runs:
                argv = [str(Path(__file__).resolve()), "--strategy", name, "--model", args.model, "--steps",
                        str(args.steps), "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
                        "--top", str(args.top)]
                runs[name].append(launch_local(argv, args.devices, Path(tmp), timeout=1200, name=f"{name}-{rep}"))
    summary = summarise(runs)
    print(f"model {args.model}, {args.devices} CPU processes, dp_shard={args.devices}, {args.repeats} alternating "
          f"runs, steps 4..{args.steps - 5} timed, rank 0 profiled over steps {args.steps - 4}..{args.steps - 1}")
    print(table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(["python", "bench/step_profile.py", *sys.argv[1:]]),
                                               "summary": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
