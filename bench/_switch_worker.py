"""One rank of `bench/switch.py`: train, switch layouts at step boundaries, measure each switch against the raw
point-to-point bandwidth of the same pairs and against a naive all-gather-and-slice baseline.

Writes this rank's JSON to ``--out``. Nothing here changes dynatrain: the engine's `TransitionStats` (which the
`SwitchReport` does not carry) are captured by the strategy's ``switch_transfer``: `run_transition`, wrapped.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import time
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dynatrain
from dynatrain.switch.in_world import planner_rank_map
from dynatrain.launch.local import finish_rank
from dynatrain.engine import run_transition, wire
from dynatrain.engine.local_copies import states_kept_in_place
from dynatrain.engine.wire import box_view, recv_staged, send_staged, slots, split_message
from dynatrain.data import LlamaDataModule
from dynatrain.engine import torch_dtype
from dynatrain.lm.causal_lm import LlamaLM
from dynatrain.models.parallelize import mesh_safe
from dynatrain.planner.schedule import plan_switch
from dynatrain.models.specs import rule_for_param
from dynatrain.switch.capture import local_tensor
from dynatrain.vps.layout import StateSpec

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
DIRECT_MIN_BYTES = wire.DIRECT_MIN_BYTES  # the engine's own threshold, restored after a ``direct=N`` way


def state_specs(model, opt) -> tuple[StateSpec, ...]:
    """The Transformer's weights and Adam moments with the zoo's analytic rules (names relative to the model)."""
    out = []
    for name, p in model.named_parameters():
        rule = rule_for_param(name, tuple(p.shape))
        for suffix in ("", *(f".{m}" for m in ADAM_MOMENTS)):
            out.append(StateSpec(name + suffix, tuple(p.shape), str(p.dtype).removeprefix("torch."), rule.tp_dim))
    return tuple(out)


def collect_sources(model, opt) -> dict:
    out = {}
    for name, p in model.named_parameters():
        out[name] = local_tensor(p.detach())
        for m in ADAM_MOMENTS:
            out[f"{name}.{m}"] = local_tensor(opt.state[p][m])
    return out
from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig
from _raw_p2p import budget_exchange, pair_bytes, raw_exchange  # this folder
from _trainer import bench_trainer  # this folder

warnings.filterwarnings("ignore")
MiB = 2**20


# ---------------------------------------------------------------------------------------------- memory (RSS)
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_mark() -> int:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS and return the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def rss_peak() -> int:
    return _status("VmHWM")


# ---------------------------------------------------------------------------------------------- engine capture
CAPTURE: dict = {}


def _captured_run_transition(plan, rank, src, **kw):
    if "streamed" in CAPTURE:
        kw["streamed"] = CAPTURE["streamed"]
    t0 = time.perf_counter()
    dist.barrier()  # ranks finish `build` at different times; the skew is reported, not counted as transfer
    CAPTURE["barrier_wait_s"] = time.perf_counter() - t0
    rss0 = rss_mark()
    dst, stats = run_transition(plan, rank, src, **kw)
    CAPTURE["rss_before"] = rss0
    CAPTURE["rss_peak"] = rss_peak()
    CAPTURE["plan"] = plan
    CAPTURE["stats"] = stats.as_dict()
    return dst, stats


# ---------------------------------------------------------------------------------------------- raw bandwidth
def schedule_replay(plan, rank: int, repeats: int) -> list[float]:
    """The engine's own rounds and messages (same sizes, same pairs, one batch per round) on one preallocated
    staging buffer, without packing, local copies or unpacking: the wire cost of the schedule alone."""
    rp = plan.rank_plan(rank)
    size = max([rp.staging_bytes(k) for k in range(rp.num_rounds)] or [0])
    staging = torch.ones(size + 16 * 64, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for k in range(rp.num_rounds):
            ops, pos = [], 0
            for m in rp.sends[k]:
                ops.append(dist.P2POp(dist.isend, staging[pos:pos + m.nbytes], peer=m.dst))
                pos += m.nbytes
            for m in rp.recvs[k]:
                ops.append(dist.P2POp(dist.irecv, staging[pos:pos + m.nbytes], peer=m.src))
                pos += m.nbytes
            for w in (dist.batch_isend_irecv(ops) if ops else []):
                w.wait()
        times.append(time.perf_counter() - t0)
    del staging
    return times


def copy_bound(plan, rank: int, repeats: int) -> list[float]:
    """The copies this rank's part of ``plan`` cannot do without, alone, on tensors of the states' own local shapes
    (allocated and touched before the clock): each strided send packed into a staging buffer, each strided receive
    unpacked out of one, each local copy; the wire's operations split as the engine splits them. Added to the wire's
    own time under the budget, the time of a transfer that overlaps nothing (the copy-speed bound). A state the
    engine keeps in place (`states_kept_in_place`) costs no copy."""
    rp, old, new = plan.rank_plan(rank), plan.old, plan.new
    kept = states_kept_in_place(plan, rank)
    dtypes = {st.name: torch_dtype(st.dtype) for st in old.states}
    src = {n: torch.ones(old.shards(n, rank).local_shape, dtype=dtypes[n])
           for n in {t.state for k in range(rp.num_rounds) for m in rp.sends[k] for t in m.pieces}
           | {t.state for k in range(rp.num_rounds) for t in rp.local_copies[k] if t.state not in kept}}
    dst = {n: torch.zeros(new.shards(n, rank).local_shape, dtype=dtypes[n])
           for n in {t.state for k in range(rp.num_rounds) for m in rp.recvs[k] for t in m.pieces}
           | {t.state for k in range(rp.num_rounds) for t in rp.local_copies[k] if t.state not in kept}}
    rounds = [([op for m in rp.sends[k] for op in split_message(m, old, new, m.dst)],
               [op for m in rp.recvs[k] for op in split_message(m, old, new, m.src)],
               [t for t in rp.local_copies[k] if t.state not in kept])
              for k in range(rp.num_rounds)]
    size = max([slots(r, slots(s_, 0, send_staged)[1], recv_staged)[1] for s_, r, _ in rounds] or [0])
    staging = torch.ones(size, dtype=torch.uint8)

    def piece(t, side):
        layout, tensors, shard, box = ((old, src, t.src_shard, t.src_box) if side == "src"
                                       else (new, dst, t.dst_shard, t.dst_box))
        who = t.src if side == "src" else t.dst
        return box_view(tensors[t.state], layout.shards(t.state, who).offsets[shard], box)

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for sends, recvs, copies in rounds:
            offs, end = slots(sends, 0, send_staged)
            for op, off in zip(sends, offs):
                if send_staged(op):
                    for t in op.pieces:
                        view = piece(t, "src")
                        staging[off:off + t.nbytes].view(view.dtype).view(view.shape).copy_(view)
                        off += t.nbytes
            offs, _ = slots(recvs, end, recv_staged)
            for op, off in zip(recvs, offs):
                if recv_staged(op):
                    for t in op.pieces:
                        out = piece(t, "dst")
                        out.copy_(staging[off:off + t.nbytes].view(out.dtype).view(out.shape))
                        off += t.nbytes
            for t in copies:
                piece(t, "dst").copy_(piece(t, "src"))
        times.append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------------------------------------- naive baseline
def _tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    return hashlib.sha1(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"").hexdigest()


def naive_switch(strategy, module, target: str, budget_mb: float) -> tuple[dict, dict[str, str]]:
    """All-gather every parameter and Adam moment (`DTensor.full_tensor()`), slice this rank's shard of the
    target layout, drop the full tensor. Returns (figures, digest per state of the result)."""
    rank = strategy.global_rank
    model, opt = module.model, strategy.optimizers[0]
    target_cfg = ParallelConfig.parse(target)
    specs = state_specs(model, opt)
    old_layout = Layout.from_config(specs, strategy.parallel_config, rank_map=strategy.positions)
    plan = plan_switch(old_layout, target_cfg, rank_map=planner_rank_map(strategy.switching.rank_map),
                       budget_bytes=int(budget_mb * MiB))
    if not mesh_safe(plan.new.rank_map, target_cfg):
        plan = plan_switch(old_layout, target_cfg, rank_map="identity", budget_bytes=int(budget_mb * MiB))
    new = plan.new  # the same target positions the engine will use, so the results can be compared
    src = collect_sources(model, opt)
    src_bytes = sum(t.numel() * t.element_size() for t in src.values())
    del src
    gc.collect()
    dist.barrier()
    rss0 = rss_mark()
    live = peak = src_bytes
    out: dict[str, torch.Tensor] = {}
    t_gather = t_slice = 0.0
    t0 = time.perf_counter()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            tensors = [(pname, p.detach())] + [(f"{pname}.{m}", opt.state[p][m]) for m in ADAM_MOMENTS]
            for sname, t in tensors:
                a = time.perf_counter()
                full = t.full_tensor() if isinstance(t, DTensor) else t
                b = time.perf_counter()
                full_bytes = full.numel() * full.element_size()
                peak = max(peak, live + full_bytes)
                sh = new.shards(sname, rank)
                res = torch.empty(sh.local_shape, dtype=torch_dtype(str(full.dtype).removeprefix("torch.")))
                for box, off in zip(sh.boxes, sh.offsets):
                    res[tuple(slice(o, o + n) for o, n in zip(off, box.shape))].copy_(full[box.slices()])
                live += res.numel() * res.element_size()
                out[sname] = res
                del full
                t_gather += b - a
                t_slice += time.perf_counter() - b
    seconds = time.perf_counter() - t0
    rss = rss_peak()
    dst_bytes = live - src_bytes
    digests = {k: _tensor_digest(v) for k, v in out.items()}
    del out
    gc.collect()
    figures = {
        "seconds": seconds, "seconds_gather": t_gather, "seconds_slice": t_slice, "peak_bytes": peak,
        "src_bytes": src_bytes, "dst_bytes": dst_bytes, "rss_before": rss0, "rss_peak": rss,
    }
    return figures, digests


# ---------------------------------------------------------------------------------------------- the script
class SwitchBench(pl.Callback):
    def __init__(self, events: list[tuple[str, float, bool, str]], steps_between: int, raw_repeats: int, chunk: int):
        self.events = events  # (target, budget MiB, run the naive baseline first, the engine's way)
        self.steps_between = steps_between
        self.raw_repeats = raw_repeats
        self.chunk = chunk
        self.results: list[dict] = []
        self.step_times: list[float] = []
        self._last = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        step = trainer.global_step
        if not strategy.at_step_boundary():
            return
        now = time.perf_counter()
        if self._last is not None and self._last[0] != step:
            self.step_times.append(now - self._last[1])
        self._last = (step, now)
        done = len(self.results)
        if done >= len(self.events) or step != (done + 1) * self.steps_between:
            return
        target, budget, with_naive, way = self.events[done]
        rank = strategy.global_rank
        entry: dict = {"step": step, "budget_mb": budget, "engine_way": way}
        digests = None
        if with_naive:
            entry["naive"], digests = naive_switch(strategy, pl_module, target, budget)
        gc.collect()
        t0 = time.perf_counter()
        dist.barrier()
        entry["pre_barrier_wait_s"] = time.perf_counter() - t0
        CAPTURE.clear()
        if way.startswith("direct="):
            wire.DIRECT_MIN_BYTES = int(way.split("=")[1])
        else:
            wire.DIRECT_MIN_BYTES = DIRECT_MIN_BYTES
            if way != "default":
                CAPTURE["streamed"] = way == "streamed"
        report = strategy.switch(target, budget_mb=budget)
        entry["report"] = report.as_dict()
        entry["engine"] = CAPTURE["stats"]
        entry["barrier_wait_s"] = CAPTURE["barrier_wait_s"]
        entry["rss_before"], entry["rss_peak"] = CAPTURE["rss_before"], CAPTURE["rss_peak"]
        plan = CAPTURE.pop("plan")
        if digests is not None:
            mine = {k: _tensor_digest(v) for k, v in collect_sources(pl_module.model, strategy.optimizers[0]).items()}
            entry["naive"]["matches_engine"] = mine == digests
        pairs = pair_bytes(plan)
        entry["pairs"] = {f"{s}->{d}": n for (s, d), n in sorted(pairs.items())}
        entry["bytes_moved_plan"] = plan.bytes_moved
        gc.collect()
        entry["raw_seconds"] = raw_exchange(pairs, rank, self.chunk, self.raw_repeats)
        entry["budget_raw_seconds"] = budget_exchange(pairs, rank, int(budget * MiB), self.raw_repeats)
        entry["replay_seconds"] = schedule_replay(plan, rank, self.raw_repeats)
        entry["copy_seconds"] = copy_bound(plan, rank, self.raw_repeats)
        del plan
        gc.collect()
        self.results.append(entry)
        self._last = (step, time.perf_counter())  # the next step's time excludes the switch and the measurements


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="125m")
    ap.add_argument("--source", default="dp_shard=4")
    ap.add_argument("--target", default="dp_shard=2,tp=2")
    ap.add_argument("--budgets", default="64", help="MiB, comma separated: one switch there and back per budget")
    ap.add_argument("--naive-budget", type=float, default=64.0, help="run the naive baseline before this pair")
    ap.add_argument("--steps-between", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--raw-repeats", type=int, default=2)
    ap.add_argument("--chunk-mb", type=float, default=64.0)
    ap.add_argument("--engine-ways", default="default",
                    help="streamed,batched: each switch pair once per way of posting a round, taking turns; "
                         "direct=N: pieces of N bytes or more go on the wire in place (the default's threshold "
                         "otherwise)")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    budgets = [float(b) for b in args.budgets.split(",")]
    events = []
    for b in budgets:
        for i, way in enumerate(args.engine_ways.split(",")):
            naive = b == args.naive_budget and i == 0
            events += [(args.target, b, naive, way), (args.source, b, naive, way)]
    pl.seed_everything(1234, verbose=False)
    dp0 = ParallelConfig.parse(args.source).dp_size
    strategy = dynatrain.DynaTrainStrategy(parallel=args.source,
                                           switching={"switch_budget_mb": budgets[0], "verify_switches": False})
    strategy.switch_transfer = _captured_run_transition
    bench = SwitchBench(events, args.steps_between, args.raw_repeats, int(args.chunk_mb * MiB))
    steps = args.steps_between * (len(events) + 1)
    trainer = bench_trainer(strategy, world, steps, [bench])
    module = LlamaLM(model=args.model, lr=1e-3, warmup_steps=2)
    data = LlamaDataModule(seq_len=args.seq_len, global_batch_size=args.micro_batch * dp0,
                           micro_batch_size=args.micro_batch, max_corpus_bytes=1_000_000)
    trainer.fit(module, datamodule=data)
    result = {"rank": strategy.global_rank, "losses": module.step_losses, "step_times": bench.step_times,
                   "switches": bench.results}
    del trainer, module, strategy, bench
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
