"""The CUDA/NCCL path in a few minutes: device memcpy bandwidth, a training step, and the engine against raw
point-to-point, written to one JSON (default ``bench/results/gpu.json``).

    bash bench/gpu_check.sh                      # on a CUDA machine (what the script below runs)
    python bench/gpu_check.py --device cpu --quick --json /tmp/gpu.json   # the same code on CPU and gloo

* **memcpy**: a 1 GiB device-to-device copy (``Tensor.copy_``), best of 5, timed with device events.
* **step**: `LlamaLM` (``--model``, default ``125m``) under ``strategy="dynatrain"`` on one device, median step time
  after 3 warm-up steps.
* **engine**: the states of ``--model`` (fp32 + Adam) switched ``dp_shard=2 -> tp=2`` and back by `run_transition`
  between two processes, against the same bytes between the same pairs posted at once from preallocated buffers
  (raw). With one GPU both processes share it over NCCL only when the backend allows; otherwise gloo on CPU
  tensors is measured and the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
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


def step_time(device: torch.device, model: str, steps: int) -> dict:
    import lightning.pytorch as pl

    from dynatrain import DynaTrainStrategy
    from dynatrain.data import LlamaDataModule
    from dynatrain.llama_lm import LlamaLM
    from _trainer import bench_trainer  # this folder

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_end(self, trainer, *args) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.marks.append(time.perf_counter())

    clock = Clock()
    trainer = bench_trainer(DynaTrainStrategy(parallel="dp_shard=1"), 1, steps + 3, [clock], accelerator=device.type)
    data = LlamaDataModule(seq_len=256, global_batch_size=4, micro_batch_size=4, max_corpus_bytes=2_000_000)
    trainer.fit(LlamaLM(model=model, warmup_steps=1), datamodule=data)
    gaps = [b - a for a, b in zip(clock.marks[2:], clock.marks[3:])]
    return {"model": model, "steps_timed": len(gaps), "median_step_s": statistics.median(gaps),
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
    layouts = ["dp_shard=2", "tp=2", "dp_shard=2"]
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
    mp.spawn(_engine_rank, args=(2, port, backend, device_type, model, str(out)), nprocs=2, join=True)
    return {"backend": backend, "tensors_on": device_type, "switches": json.loads(out.read_text()),
            "note": None if backend == "nccl" or device.type == "cpu" else
            "one GPU: NCCL needs a device per process, so the engine ran on gloo with CPU tensors"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="125m")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--memcpy-mib", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="debug model, 3 steps, 64 MiB copies (a smoke test)")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "gpu.json"))
    args = ap.parse_args()
    if args.quick:
        args.model, args.steps, args.memcpy_mib = "debug", 3, 64
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --device cpu for the CPU path, or on a CUDA machine")
    import tempfile

    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
              "command": " ".join(sys.argv)}
    result["memcpy"] = memcpy_bandwidth(device, args.memcpy_mib * 2**20)
    print(json.dumps({"memcpy": result["memcpy"]}), flush=True)
    result["step"] = step_time(device, args.model, args.steps)
    print(json.dumps({"step": result["step"]}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result["engine"] = engine_throughput(device, args.model, Path(tmp))
    print(json.dumps({"engine": result["engine"]}), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
