"""One rank of `bench/soak.py`: train the debug Llama and switch its layout at every ``--every-n-steps``-th
optimizer-step boundary, cycling through same-world layouts, ``--switches`` times; sample what a leak would grow.

Per sample: RSS (VmRSS), glibc's bytes in use and free, open file descriptors, OS and Python threads, live process
groups (torch's c10d registry) and how many were ever created, DeviceMesh / Transformer objects alive, gc-tracked
objects, misses of DTensor's sharding-propagation cache, c10d's work registry, and the strategy's own caches
(`meshes`, `switch_reports`). A sample is taken after a full `gc.collect()` at the first micro-batch after a
switch: after the first switch, after the warm-up (the "start"), every ``--sample-every`` switches, and after the
last switch (the "end"). Writes this rank's JSON to ``--out``.

Diagnosis options (they change what is measured): ``--trim`` calls `malloc_trim(0)` before each sample,
``--trim-after-switch`` after every switch (the proposed fix, emulated), ``--tracemalloc`` traces Python
allocations on rank 0 from the warm-up and reports what grew over the run after one more cycle.
"""

from __future__ import annotations

import argparse
import gc
import os
import threading
import time
import warnings
from dataclasses import replace

import lightning.pytorch as pl
import torch
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

import dynatrain
from dynatrain.data import LlamaDataModule
from dynatrain.launch.local import finish_rank
from dynatrain.lm.causal_lm import LlamaLM
from dynatrain.runtime.memory import malloc_figures, trim_heap
from dynatrain.models.configs import get_model_config
from dynatrain.models.llama import Transformer
from dynatrain.vps.parallel_config import ParallelConfig
from _trainer import bench_trainer  # this folder

warnings.filterwarnings("ignore")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def _count(cls) -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, cls))


def _sharding_cache() -> int:
    """Misses of DTensor's C++ sharding-propagation cache (the dispatch fast path, unbounded, one entry per miss):
    flat after the warm-up when its keys from a layout's earlier visits match again."""
    try:
        return int(torch._C._get_DTensor_sharding_propagator_cache_stats()[1])
    except Exception:  # a private API: leave it out rather than fail the soak
        return -1


def _work_registry() -> int:
    """Collective works registered by functional collectives and not waited on yet (c10d's work registry)."""
    try:
        from torch._C._distributed_c10d import _get_work_registry_size

        return int(_get_work_registry_size())
    except Exception:
        return -1


def sample(strategy, switches: int, step: int, trim: bool = False) -> dict:
    """What a switch could leak, measured after a full collection (and `malloc_trim(0)` with ``trim``)."""
    unreachable = gc.collect()
    if trim:
        trim_heap()
    world = c10d._world
    return {**malloc_figures(),
        "switches": switches,
        "step": step,
        "time": time.time(),
        "rss_bytes": _status("VmRSS") * 1024,
        "rss_anon_bytes": _status("RssAnon") * 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads_os": _status("Threads"),
        "threads_py": threading.active_count(),
        # Process groups torch still holds (the default group included) and how many it ever created.
        "groups_live": len(world.pg_map),
        "group_names": len(world.pg_names),
        "groups_created": world.group_count,
        "meshes_alive": _count(DeviceMesh),
        "transformers_alive": _count(Transformer),
        "gc_objects": len(gc.get_objects()),
        "gc_unreachable_collected": unreachable,
        "gc_garbage": len(gc.garbage),
        "mesh_cache": len(strategy.meshes),
        "sharding_cache_misses": _sharding_cache(),
        "work_registry": _work_registry(),
        "switch_reports": len(strategy.switch_reports),
    }


class Soak(pl.Callback):
    """Requests the next layout of the cycle at the first micro-batch of every n-th optimizer step; the strategy
    runs it at the end of that step. Counts completed switches and samples after them."""

    def __init__(self, cycle: list[str], switches: int, every_n_steps: int, warmup: int, sample_every: int,
                 verify_every: int, trim: bool = False, trace: bool = False, trim_after: bool = False) -> None:
        self.cycle = cycle
        self.total = switches
        self.every = every_n_steps
        self.warmup = warmup
        self.sample_every = sample_every
        self.verify_every = verify_every
        self.trim = trim
        self.trim_after = trim_after  # the proposed fix, emulated: malloc_trim(0) at the end of every switch
        self.trace = trace  # tracemalloc from the warm-up sample to the end (diagnosis; slows the rank down)
        self._snapshot = None
        self.traced: list[dict] = []
        self.trim_s: list[float] = []
        self.done = 0
        self.requested = False
        self.last_request_step = -10**9
        self.samples: list[dict] = []
        self.stalls: list[float] = []
        self.verified = 0
        self.first_switch_time: float | None = None
        self.last_switch_time: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        strategy = trainer.strategy
        if self.requested and not strategy.switch_pending:  # the switch requested last time has run
            self.requested = False
            self.done += 1
            report = strategy.switch_reports[-1]
            self.stalls.append(report.stall_s)
            self.verified += bool(report.verified)
            self.last_switch_time = time.time()
            strategy.switching = replace(strategy.switching, verify_switches=False)
            if self.trim_after:
                t = time.perf_counter()
                trim_heap()
                self.trim_s.append(time.perf_counter() - t)
            if (self.done == 1 or self.done == self.warmup or self.done == self.total
                    or self.done % self.sample_every == 0):
                self.samples.append(sample(strategy, self.done, trainer.global_step, self.trim))
            if self.trace:
                self._tracemalloc()
        if self.done == 0 and not self.samples:
            self.samples.append(sample(strategy, 0, trainer.global_step, self.trim))  # before any switch
        if (self.done >= self.total or self.requested or not strategy.at_step_boundary()
                or trainer.global_step - self.last_request_step < self.every):
            return
        target = self.cycle[(self.done + 1) % len(self.cycle)]  # the cycle starts at the initial layout
        verify = self.verify_every > 0 and (self.done + 1) % self.verify_every == 0
        strategy.switching = replace(strategy.switching, verify_switches=verify)
        if self.first_switch_time is None:
            self.first_switch_time = time.time()
        strategy.request_switch(target)
        self.requested = True
        self.last_request_step = trainer.global_step

    def _tracemalloc(self) -> None:
        """Python allocations alive at the end that were not at warm-up + one cycle (same layout), by traceback."""
        import tracemalloc

        if self.done == self.warmup:
            tracemalloc.start(12)
        elif self.done == self.warmup + len(self.cycle) and tracemalloc.is_tracing():
            self._snapshot = (tracemalloc.take_snapshot(), tracemalloc.get_traced_memory()[0], self.done)
        elif self.done == self.total and self._snapshot is not None:
            first, traced0, at = self._snapshot
            second = tracemalloc.take_snapshot()
            traced = tracemalloc.get_traced_memory()[0] - traced0
            self.traced = []
            for key, n in (("filename", 10), ("lineno", 15), ("traceback", 10)):
                diff = sorted(second.compare_to(first, key), key=lambda d: -d.size_diff)[:n]
                self.traced += [{"from": at, "to": self.done, "traced_diff": traced, "by": key,
                                 "size_diff": d.size_diff, "count_diff": d.count_diff,
                                 "traceback": [f"{f.filename}:{f.lineno}" for f in d.traceback]} for d in diff]
            tracemalloc.stop()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.done >= self.total and not self.requested:
            trainer.should_stop = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--layouts", required=True, help="';'-separated cycle; the first is the initial one")
    ap.add_argument("--switches", type=int, default=200)
    ap.add_argument("--every-n-steps", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--sample-every", type=int, default=10)
    ap.add_argument("--verify-every", type=int, default=10)
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) before each sample (diagnosis)")
    ap.add_argument("--trim-after-switch", action="store_true", help="malloc_trim(0) after every switch")
    ap.add_argument("--tracemalloc", action="store_true", help="diagnosis: Python allocations that grow")
    ap.add_argument("--budget-mb", type=float, default=64.0)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=1)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = {"n_layers": args.layers} if args.layers else {}
    model_cfg = get_model_config(args.model).with_overrides(**overrides)
    cycle = [ParallelConfig.parse(t).validate(model_cfg, world).short() for t in args.layouts.split(";") if t]
    for c in cycle:
        if args.global_batch % (ParallelConfig.parse(c).dp_size * args.micro_batch):
            raise SystemExit(f"{c}: global batch {args.global_batch} is not a multiple of dp x micro-batch")
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel=cycle[0],
                                           switching={"verify_switches": False, "switch_budget_mb": args.budget_mb})
    soak = Soak(cycle, args.switches, args.every_n_steps, min(args.warmup, args.switches), args.sample_every,
                args.verify_every, args.trim, args.tracemalloc, args.trim_after_switch)
    steps = (args.switches + 2) * args.every_n_steps + 2
    trainer = bench_trainer(strategy, world, steps, [soak])
    module = LlamaLM(model=args.model, model_overrides=overrides, lr=1e-3, warmup_steps=2)
    needed = (steps + 4) * args.global_batch * (args.seq_len + 1)
    data = LlamaDataModule(seq_len=args.seq_len, global_batch_size=args.global_batch,
                           micro_batch_size=args.micro_batch, max_corpus_bytes=max(400_000, 2 * needed))
    t0 = time.time()
    trainer.fit(module, datamodule=data)
    result = {
        "rank": strategy.global_rank, "cycle": cycle, "switches_done": soak.done, "global_step": trainer.global_step,
        "final_layout": strategy.parallel_config.short(), "samples": soak.samples, "stalls_s": soak.stalls,
        "verified": soak.verified, "fit_s": time.time() - t0,
        "switching_s": (soak.last_switch_time or 0) - (soak.first_switch_time or 0),
        "tracemalloc_growth": soak.traced, "trim_after_switch_s": soak.trim_s,
        "losses": module.step_losses, "torch": torch.__version__,
    }
    del trainer, module, strategy, soak
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
