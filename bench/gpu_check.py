"""The CUDA/NCCL path in a few minutes: device memcpy bandwidth, training steps, and the engine against raw
point-to-point, written to one JSON (default ``bench/results/gpu.json``).

    bash bench/gpu_check.sh                      # on a CUDA machine (what the script below runs)
    python bench/gpu_check.py --device cpu --quick --json /tmp/gpu.json   # the same code on CPU and gloo

* **memcpy**: a 1 GiB device-to-device copy (``Tensor.copy_``), best of 5, timed with device events.
* **step**: `LlamaLM` (``--model``, default ``125m``, fp32) under ``strategy="dynatrain"`` on one device, median step
  time after 3 warm-up steps; on CUDA also ``1b`` with bf16 parameters at 8 x 2048 tokens, with the process group's
  backend, tokens per second and 6 x parameters x tokens per second.
* **engine**: the states of ``--model`` (fp32 + Adam) switched ``dp_shard=2 -> tp=2`` and back, three times, by
  `run_transition` between two processes, against the same bytes between the same pairs posted at once from
  preallocated buffers (raw). NCCL refuses two ranks on one GPU, so with one GPU gloo on CPU tensors is measured and
  the JSON says so.
* A part that fails leaves the others' figures in the JSON, with its error, and the exit status is not 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def memcpy_bandwidth(device: torch.device, nbytes: int) -> dict:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    best = min(_timed(device, lambda: b.copy_(a)) for _ in range(5))
    return {"bytes": nbytes, "seconds": best, "gib_per_s": nbytes / best / 2**30}


def step_time(device: torch.device, model: str, steps: int, seq_len: int = 256, batch: int = 4,
              param_dtype: str | None = None) -> dict:
    import lightning.pytorch as pl
    import torch.distributed as dist

    from dynatrain import DynaTrainStrategy
    from dynatrain.data import LlamaDataModule
    from dynatrain.llama_lm import LlamaLM
    from dynatrain.models.configs import get_model_config
    from _trainer import bench_trainer  # this folder

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.backend: str | None = None

        def on_train_batch_end(self, trainer, *args) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.marks.append(time.perf_counter())
            self.backend = dist.get_backend() if dist.is_initialized() else None

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = Clock()
    strategy = DynaTrainStrategy(parallel="dp_shard=1", param_dtype=param_dtype)
    trainer = bench_trainer(strategy, 1, steps + 3, [clock], accelerator=device.type)
    corpus = max(2_000_000, 8 * seq_len * batch * (steps + 4))
    data = LlamaDataModule(seq_len=seq_len, global_batch_size=batch, micro_batch_size=batch, max_corpus_bytes=corpus)
    trainer.fit(LlamaLM(model=model, warmup_steps=1), datamodule=data)
    gaps = [b - a for a, b in zip(clock.marks[2:], clock.marks[3:])]
    median = statistics.median(gaps)
    params = get_model_config(model).num_params()
    tokens = seq_len * batch
    return {"model": model, "seq_len": seq_len, "batch": batch, "param_dtype": param_dtype,
            "process_group_backend": clock.backend, "steps_timed": len(gaps), "median_step_s": median,
            "spread_s": [min(gaps), max(gaps)], "tokens_per_s": tokens / median,
            # 6 x parameters x tokens: the matrix work of a step without attention's, a floor of the true rate.
            "model_tflop_per_s": 6 * params * tokens / median / 1e12,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def _engine_rank(rank: int, world: int, port: int, backend: str, device_type: str, model: str, out: str) -> None:
    import torch.distributed as dist

    from dynatrain.engine import run_transition, torch_dtype
    from dynatrain.models.specs import layout_for_model
    from dynatrain.planner.schedule import plan_switch
    from dynatrain.vps import ParallelConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(device_type, rank if device_type == "cuda" and torch.cuda.device_count() > 1 else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    rows = []
    layouts = ["dp_shard=2", "tp=2"] * 3 + ["dp_shard=2"]  # each way three times: the first pays for warm-up
    for a, b in zip(layouts, layouts[1:]):
        old = layout_for_model(model, ParallelConfig.parse(a))
        plan = plan_switch(old, b, budget_bytes=256 * 2**20, rank_map="identity")
        src = {s.name: torch.ones(old.shards(s.name, rank).local_shape, dtype=torch_dtype(s.dtype), device=device)
               for s in old.states}
        dist.barrier()
        t = time.perf_counter()
        _, stats = run_transition(plan, rank, src, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        engine_s = time.perf_counter() - t
        moved = stats.bytes_sent + stats.bytes_received
        # Raw: the same bytes per peer, all posted at once from preallocated, touched buffers.
        peer = 1 - rank
        sent, recv = plan.rank_bytes()
        out_buf = torch.ones(max(sent.get(rank, 0), 1), dtype=torch.uint8, device=device)
        in_buf = torch.empty(max(recv.get(rank, 0), 1), dtype=torch.uint8, device=device).fill_(0)
        dist.barrier()
        t = time.perf_counter()
        ops = [dist.P2POp(dist.isend, out_buf, peer), dist.P2POp(dist.irecv, in_buf, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        raw_s = time.perf_counter() - t
        rows.append({"switch": f"{a} -> {b}", "bytes_sent_and_received": moved, "engine_s": engine_s, "raw_s": raw_s,
                     "bytes_zero_copy": stats.bytes_zero_copy, "peak_bytes": stats.peak_bytes,
                     "process_threads": torch.get_num_threads(), "copy_threads": stats.copy_threads,
                     **{k: getattr(stats, k)
                        for k in ("seconds_pack", "seconds_wire", "seconds_local", "seconds_unpack")},
                     "engine_gib_per_s": moved / engine_s / 2**30, "raw_gib_per_s": moved / raw_s / 2**30,
                     "ratio": raw_s / engine_s})
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def engine_throughput(device: torch.device, model: str, tmp: Path) -> dict:
    import socket

    import torch.multiprocessing as mp

    backend = "nccl" if device.type == "cuda" and torch.cuda.device_count() > 1 else "gloo"
    device_type = device.type if backend == "nccl" or device.type == "cpu" else "cpu"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / "engine.json"
    from dynatrain.memory import HEAP_ENV, heap_env

    # The ranks start with the heap settings dynatrain's launchers give (DYNATRAIN_HEAP), read by glibc at exec.
    saved = dict(os.environ)
    os.environ.update(heap_env(os.environ))
    tunables = os.environ.get("GLIBC_TUNABLES")
    try:
        mp.spawn(_engine_rank, args=(2, port, backend, device_type, model, str(out)), nprocs=2, join=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"backend": backend, "tensors_on": device_type, "heap": os.environ.get(HEAP_ENV, "reuse"),
            "glibc_tunables": tunables,
            "switches": json.loads(out.read_text()),
            "note": None if backend == "nccl" or device.type == "cpu" else
            "one GPU: NCCL needs a device per process, so the engine ran on gloo with CPU tensors"}


def _guarded(part) -> dict:
    """One part's result, or its error: a part that fails leaves the others' figures in the JSON."""
    try:
        return part()
    except Exception as exc:  # noqa: BLE001 - reported in the JSON and by the exit status
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="125m")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--memcpy-mib", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="debug model, 3 steps, 64 MiB copies (a smoke test)")
    ap.add_argument("--parts", default="memcpy,step,engine", help="which parts to run, comma-separated")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "gpu.json"))
    args = ap.parse_args()
    if args.quick:
        args.model, args.steps, args.memcpy_mib = "debug", 3, 64
    parts = set(args.parts.split(","))
    if not parts or parts - {"memcpy", "step", "engine"}:
        sys.exit(f"--parts {args.parts!r}: name some of memcpy, step, engine")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --device cpu for the CPU path, or on a CUDA machine")
    import tempfile

    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
              "command": " ".join(sys.argv)}
    if device.type == "cuda":
        result["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    if "memcpy" in parts:
        result["memcpy"] = _guarded(lambda: memcpy_bandwidth(device, args.memcpy_mib * 2**20))
        print(json.dumps({"memcpy": result["memcpy"]}), flush=True)
    runs = [(args.model, args.seq_len, args.batch, None)]
    if device.type == "cuda" and not args.quick:
        runs.append(("1b", 2048, 8, "bfloat16"))  # a step long enough to say what the device does
    if "step" in parts:
        result["steps"] = []
        for model, seq_len, batch, dtype in runs:
            result["steps"].append(_guarded(lambda: step_time(device, model, args.steps, seq_len, batch, dtype)))
            print(json.dumps({"step": result["steps"][-1]}), flush=True)
    if "engine" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            result["engine"] = _guarded(lambda: engine_throughput(device, args.model, Path(tmp)))
        print(json.dumps({"engine": result["engine"]}), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    failed = [part for part in [result.get("memcpy", {}), result.get("engine", {}), *result.get("steps", [])]
              if "error" in part]
    if failed:
        sys.exit(f"{len(failed)} part(s) failed: " + "; ".join(part["error"] for part in failed))


if __name__ == "__main__":
    main()
