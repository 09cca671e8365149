"""The layout policy's memory model against measurement: peak memory of one rank over training steps of the zoo's
model on CPU, for several layouts and activation checkpointing policies, beside `policy.estimate_memory`.

How the peak is measured: torch's CPU allocator keeps no peak counter, and RSS counts the allocator's cached and
fragmented heap and the libraries (hundreds of MiB against tens of MiB of tensors), so neither is the quantity the
model predicts. `torch.profiler` with ``profile_memory`` records every tensor allocation and free of the rank
(size signed) in order; their running sum from before the model is built, through two optimizer steps (the second
has the Adam moments), is the bytes of live tensors, and its maximum is the peak. That counts exactly what the model
predicts (weights, gradients, optimizer moments, FSDP's gathered parameters, activations, logits, temporaries) and
nothing of the allocator's caching. Everything runs in float32 (the CPU default here): ``compute_dtype`` and
``reduce_dtype`` are float32 in the prediction too.

A layout ending in ``+sp`` runs with sequence parallelism (tp > 1), predicted with ``sequence_parallel=True``.

    python bench/memory_model.py [--model debug] [--seq-len 256] [--micro-batch 4] [--json out.json]
    python bench/memory_model.py --layouts "tp=2+sp;dp_shard=2,tp=2+sp" --json bench/results/memory_model/debug_sp.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYOUTS = ("dp_shard=1", "dp_shard=2", "tp=2", "dp_replicate=2", "dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2")
POLICIES = ("none", "selective:op", "selective:2", "full")


def _worker(args) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from dynatrain.launch.local import finish_rank
    from dynatrain.lm.causal_lm import _VocabParallel, _cross_entropy
    from dynatrain.models.configs import MODEL_CONFIGS
    from dynatrain.models.llama import Transformer
    from dynatrain.models.parallelize import ParallelizeOptions, init_mesh, materialize_model
    from dynatrain.models.parallelize_dense import parallelize_dense
    from dynatrain.vps.parallel_config import ParallelConfig

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    layout, sp = _split_sp(args.layout)
    pcfg = ParallelConfig.parse(layout)
    mesh = init_mesh(pcfg)
    cfg = MODEL_CONFIGS[args.model]
    if args.n_layers:
        cfg = cfg.with_overrides(n_layers=args.n_layers)
    gen = torch.Generator().manual_seed(dist.get_rank() // pcfg.tp)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len), generator=gen)
    peaks = {}
    for policy in args.policies.split(","):
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.device("meta"):
                model = Transformer(cfg)
            parallelize_dense(model, mesh, pcfg, ParallelizeOptions(
                loss_parallel=pcfg.tp > 1, activation_checkpointing=policy, sequence_parallel=sp))
            materialize_model(model, "cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
            for _ in range(2):
                loss = _cross_entropy(model(tokens), labels)
                with _VocabParallel():
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            del model, opt, loss
            gc.collect()
        # The raw allocator records (the per-op figures of prof.events() count nested ops twice).
        events = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                         if e.name() == "[memory]"))
        live = peak = 0
        for _, nbytes in events:
            live += nbytes
            peak = max(peak, live)
        peaks[policy] = {"peak_bytes": peak, "end_bytes": live, "memory_events": len(events)}
    dist.barrier()
    finish_rank(args.out, peaks)


def _split_sp(layout: str) -> tuple[str, bool]:
    """``dp_shard=2,tp=2+sp`` -> (``dp_shard=2,tp=2``, sequence parallel)."""
    return (layout[:-3], True) if layout.endswith("+sp") else (layout, False)


def _predict(layout: str, policy: str, args) -> dict:
    from dynatrain.policy import Workload, estimate_memory
    from dynatrain.vps.parallel_config import ParallelConfig

    layout, sp = _split_sp(layout)
    cfg = ParallelConfig.parse(layout)
    from dynatrain.models.specs import get_zoo_config

    model = get_zoo_config(args.model)
    if args.n_layers:
        model = model.with_overrides(n_layers=args.n_layers)
    work = Workload(model, seq_len=args.seq_len, global_batch=args.micro_batch * cfg.dp_size,
                    micro_batch=args.micro_batch, compute_dtype="float32", reduce_dtype="float32",
                    activation_checkpointing=policy, sequence_parallel=sp)
    m = estimate_memory(cfg, work)
    return {"total": m.total, "states": m.states, "grads": m.grads, "gathered": m.gathered,
            "activations": m.activations, "logits": m.logits}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=0, help="override the model's layer count")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--layouts", default=";".join(LAYOUTS),
                    help="';'-separated layouts")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return 0
    from dynatrain.launch.local import launch_local
    from dynatrain.vps.parallel_config import ParallelConfig

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(";"):
            n = ParallelConfig.parse(_split_sp(layout)[0]).world_size
            started = time.perf_counter()
            results = launch_local([str(HERE / "memory_model.py"), "--worker", "--layout", layout, "--model",
                                    args.model, "--seq-len", str(args.seq_len), "--micro-batch",
                                    str(args.micro_batch), "--policies", args.policies, "--n-layers", str(args.n_layers)],
                                   n, Path(tmp), timeout=900, name="memory")
            for policy in args.policies.split(","):
                measured = max(r[policy]["peak_bytes"] for r in results)
                predicted = _predict(layout, policy, args)
                error = (predicted["total"] - measured) / measured
                rows.append({"layout": layout, "processes": n, "policy": policy, "measured_peak": measured,
                             "per_rank_peaks": [r[policy]["peak_bytes"] for r in results],
                             "predicted": predicted, "error": error})
                print(f"{layout:<28} {policy:<13} measured {measured / 2**20:8.2f} MiB  predicted "
                      f"{predicted['total'] / 2**20:8.2f} MiB  error {error:+.1%}", flush=True)
            print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    errors = [abs(r["error"]) for r in rows]
    summary = {"max_abs_error": max(errors), "mean_abs_error": sum(errors) / len(errors),
               "within_15pct": sum(e <= 0.15 for e in errors), "rows": len(rows)}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "command": "python " + " ".join(sys.argv), "model": args.model, "seq_len": args.seq_len,
            "micro_batch": args.micro_batch, "dtype": "float32", "method": "torch.profiler profile_memory: "
            "running sum of allocations and frees, max over two training steps, max over ranks",
            "summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
