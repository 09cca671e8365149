"""One process of `bench/lost_time.py`: the same chain of world changes three ways.

The chain is ``--chain`` (``layout@processes`` per segment, e.g. ``dp_shard=4@4,dp_shard=2@2,dp_shard=4@4``). The
first change is decided at the end of step ``--warmup``; each later one, and the end of the run, ``--m`` + ``--steady``
steps after the previous change's last old-world step (the decision itself for a restart, the step the switch ran
after online, which for a scale-out waits for its new processes). At a decision rank 0 writes
``<signal-dir>/decided-<i>`` first, so the parent starts the processes a scale-out needs at once.

``--mode cold``: one segment (``--segment``) of Lightning's `ModelParallelStrategy`, resumed from ``--ckpt-dir``'s
previous segment, saved there at its decision step, then the process exits: a restart as users do it today.
``--mode warm``: the same processes stay: from segment ``--segment`` on, each segment's Trainer saves its DCP
checkpoint, the process group is destroyed, and the ranks the next segment keeps form a new one and load it in place
(a rank the next segment does not keep exits; the ones a larger segment adds are new processes).
``--mode online``: a dynatrain elastic member (or joiner, ``DYNATRAIN_JOIN=1``) that requests each change at its
decision step; the switch runs between two steps.

Every process writes wall-clock marks (``time.time()``: one clock on one machine) of its start, of the first
micro-batch and the end of every optimizer step, per Trainer it ran, and its page faults, CPU seconds, context
switches and resident bytes at the last two (``usage``).
"""

import time

T_START = time.time()  # before the imports: a new process's start-up is part of what a change costs

import argparse  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

import dynatrain  # noqa: E402
from _trainer import bench_data, bench_trainer  # noqa: E402  (this folder)
from dynatrain.elastic.manager import JOIN_CHECKPOINT  # noqa: E402
from dynatrain.settings import JOIN_ENV  # noqa: E402
from dynatrain.launch.local import finish_rank  # noqa: E402
from dynatrain.lm.causal_lm import LlamaLM  # noqa: E402
from dynatrain.runtime.memory import resident_bytes  # noqa: E402
from dynatrain.vps.parallel_config import ParallelConfig  # noqa: E402

T_IMPORTED = time.time()
warnings.filterwarnings("ignore")


def usage() -> list[float]:
    """This process's page faults (minor, major), CPU seconds (user, system) and context switches (voluntary,
    involuntary) so far, and its resident bytes: where a slow step's time went."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return [u.ru_minflt, u.ru_majflt, u.ru_utime, u.ru_stime, u.ru_nvcsw, u.ru_nivcsw, resident_bytes()]


class Clock(pl.Callback):
    """Per optimizer step: when its first micro-batch started and when it ended (this process), and `usage` at
    both marks."""

    def __init__(self) -> None:
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}
        self.usage: dict[int, list[list[float]]] = {}
        self.train_start: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.train_start = time.time()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step + 1
        if step not in self.starts:
            self.starts[step] = time.time()
            self.usage[step] = [usage()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step not in self.ends and step in self.starts:
            self.ends[step] = time.time()
            self.usage[step].append(usage())


class Decide(pl.Callback):
    """At each decision step: signal the parent (rank 0), then act: save and stop (cold, warm) or request the
    switch (online). Ends the run ``m + steady`` steps after the last change."""

    def __init__(self, args, targets: list[str], segment: int) -> None:
        self.args, self.targets, self.mode, self.segment = args, targets, args.mode, segment
        self.signal_dir = Path(args.signal_dir)
        self.save_s: dict[int, float] = {}
        self.requested: set[int] = set()
        self.start_step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step

    def next_decision(self, trainer) -> tuple[int, int]:
        """(index of the next change, or len(targets) - 1 for the end; the step it is due at)."""
        a = self.args
        if self.mode == "online" and os.environ.get(JOIN_ENV) == "1":
            done, last = self.segment, self.start_step  # joined after the step the switch ran after
        elif self.mode == "online":
            reports = trainer.strategy.switch_reports
            done, last = len(reports), (reports[-1].step if reports else None)
        else:
            done, last = self.segment, (a.warmup + (self.segment - 1) * (a.m + a.steady) if self.segment else None)
        return done, (a.warmup if last is None else last + a.m + a.steady)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.mode == "online" and (not trainer.strategy.at_step_boundary()
                                      or trainer.strategy.switch_pending):
            return
        i, due = self.next_decision(trainer)
        if step < due or i in self.requested:
            return
        if i == len(self.targets) - 1:
            trainer.should_stop = True
            return
        self.requested.add(i)
        if trainer.global_rank == 0:
            (self.signal_dir / f"decided-{i}").write_text(str(time.time()))
        if self.mode == "online":
            # A later boundary runs it: a scale-out trains on until its new processes are ready, a scale-in for one
            # more step while it is planned.
            trainer.strategy.request_switch(self.targets[i + 1], plan_ahead=True)
            return
        t0 = time.time()
        trainer.save_checkpoint(str(Path(self.args.ckpt_dir) / f"segment-{i}"))
        self.save_s[step] = time.time() - t0
        trainer.should_stop = True


def module(args) -> LlamaLM:
    return LlamaLM(model=args.model, lr=1e-3, warmup_steps=2, total_steps=100)


def segment_record(s: int, clock: Clock, decide: Decide, fit_call: float) -> dict:
    return {"segment": s, "fit_call": fit_call, "train_start": clock.train_start,
            "starts": sorted(clock.starts.items()), "ends": sorted(clock.ends.items()),
            "usage": sorted(clock.usage.items()),
            "save_s": sorted(decide.save_s.items())}


def run_restarts(args, chain: list[tuple[str, int]]) -> list[dict]:
    """Cold: one segment. Warm: this segment and every later one that keeps this rank, in this process."""
    rank, records = int(os.environ["RANK"]), []
    last = args.segment if args.mode == "cold" else len(chain) - 1
    for s in range(args.segment, last + 1):
        layout, procs = chain[s]
        if rank >= procs:
            break
        if s > args.segment:  # a warm restart: the next world on this process, its own rendezvous
            os.environ.update(WORLD_SIZE=str(procs), LOCAL_WORLD_SIZE=str(procs), MASTER_PORT=str(args.ports[s - 1]))
        pcfg = ParallelConfig.parse(layout)
        strategy = ModelParallelStrategy(data_parallel_size=pcfg.dp_size, tensor_parallel_size=pcfg.tp)
        clock, decide = Clock(), Decide(args, [c[0] for c in chain], s)
        trainer, lm = bench_trainer(strategy, procs, 10_000, [clock, decide]), module(args)
        fit_call = time.time()
        resume = str(Path(args.ckpt_dir) / f"segment-{s - 1}") if s > 0 else None
        trainer.fit(lm, datamodule=bench_data(args), ckpt_path=resume)
        records.append(segment_record(s, clock, decide, fit_call))
        del trainer, lm, strategy
        gc.collect()
        if s < last and dist.is_initialized():
            dist.destroy_process_group()
    return records


def run_online(args, chain: list[tuple[str, int]]) -> tuple[list[dict], dict]:
    joining = os.environ.get(JOIN_ENV) == "1"
    strategy = dynatrain.DynaTrainStrategy(parallel=chain[args.segment][0], switching={"verify_switches": False},
                                           elastic={"timeout": 300.0, "join_timeout": 900.0})
    clock, decide = Clock(), Decide(args, [c[0] for c in chain], args.segment)
    trainer = bench_trainer(strategy, 1 if joining else int(os.environ["WORLD_SIZE"]), 10_000, [clock, decide])
    fit_call = time.time()
    trainer.fit(module(args), datamodule=bench_data(args), ckpt_path=JOIN_CHECKPOINT if joining else None)
    extra = {"member": strategy.elastic.member_id, "left": strategy.detached,
             "reports": [r.as_dict() for r in strategy.switch_reports],
             "joined": strategy.join_report.as_dict() if strategy.join_report is not None else None}
    record = segment_record(args.segment, clock, decide, fit_call)
    del trainer, strategy
    return [record], extra


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("cold", "warm", "online"), required=True)
    ap.add_argument("--chain", required=True, help="layout@processes per segment, comma-separated")
    ap.add_argument("--warmup", type=int, required=True, help="the step the first change is decided at")
    ap.add_argument("--m", type=int, required=True)
    ap.add_argument("--steady", type=int, required=True)
    ap.add_argument("--segment", type=int, default=0, help="the segment this process starts in")
    ap.add_argument("--signal-dir", required=True)
    ap.add_argument("--ckpt-dir", default=None, help="cold, warm: where each segment's checkpoint goes")
    ap.add_argument("--ports", default="",
                    help="warm: the rendezvous store port of each segment after the first, comma-separated")
    ap.add_argument("--model", default="debug")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=4)
    args = ap.parse_args()
    args.ports = [int(x) for x in args.ports.split(",") if x]
    chain = [(c.split("@")[0], int(c.split("@")[1])) for c in args.chain.split(",")]
    pl.seed_everything(1234, verbose=False)
    extra: dict = {}
    if args.mode == "online":
        segments, extra = run_online(args, chain)
    else:
        segments = run_restarts(args, chain)
    finish_rank(args.out, {"rank": int(os.environ.get("RANK", -1)), "start": T_START, "imported": T_IMPORTED,
                           "segments": segments, "end": time.time(), **extra})


if __name__ == "__main__":
    main()
