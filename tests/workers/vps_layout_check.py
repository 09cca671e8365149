"""Build real TP + FSDP2 models for several layouts and compare what DTensor places with `vps.rules`.

For every layout, every parameter and both Adam moments (after one real optimizer step): the local tensor's
shape and DTensor's own (local shape, global offset) against the analytic box; for parameters also the
local values against the gathered full tensor cut at that box, for moments the placements against their
parameter's. Writes one JSON list of mismatches per rank (empty when all agree).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

if __name__ == "__main__" and "dynatrain" not in sys.modules:
    # Only the models and the pure VPS are needed; dynatrain/__init__ imports Lightning to register the
    # strategy (seconds of CPU per process), so register the bare package instead.
    import types

    _pkg = types.ModuleType("dynatrain")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "dynatrain")]
    sys.modules["dynatrain"] = _pkg

from dynatrain.models.specs import layout_for_model
from dynatrain.models.configs import ModelConfig, get_model_config
from dynatrain.models.parallelize import init_mesh
from dynatrain.models.parallelize_dense import build_parallel_model
from dynatrain.switch.capture import BUFFER, capture
from dynatrain.vps import Layout, ParallelConfig

# Uneven on purpose: vocab 10 and ffn 6 do not split evenly, and ffn 6 over dp_shard=4 leaves an empty shard.
TINY = ModelConfig("tiny-uneven", dim=12, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=10, ffn_dim=6,
                   max_seq_len=16)
CASES = [
    ("debug", "dp_shard=4"),
    ("debug", "tp=4"),
    ("debug", "dp_shard=2,tp=2"),
    ("debug", "dp_replicate=2,dp_shard=2"),
    ("debug", "dp_replicate=2,tp=2"),
    ("tiny", "dp_shard=4"),
    ("tiny", "dp_shard=2,tp=2"),
]


def check(model_cfg: ModelConfig, pcfg: ParallelConfig, rank: int) -> tuple[list[str], int, int]:
    mesh = init_mesh(pcfg)
    model = build_parallel_model(model_cfg, pcfg, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # A real step creates the moments; sharded gradients shaped like FSDP2's stand in for a backward pass.
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    opt.step()
    layout = layout_for_model(model_cfg, pcfg)
    problems, checked, empty = [], 0, 0
    # The placements read from the live model give the analytic boxes, at every position.
    cap = capture(model, opt, mesh)
    routed = [i for i, s in enumerate(cap.specs) if cap.param_of[s.name][1] != BUFFER]  # the zoo plans no buffer
    cap.specs, cap.shardings = tuple(cap.specs[i] for i in routed), tuple(cap.shardings[i] for i in routed)
    captured = Layout.from_shardings(cap.specs, cap.shardings, pcfg)
    if sorted((s.name, s.shape, s.dtype) for s in cap.specs) != sorted((s.name, s.shape, s.dtype) for s in layout.states):
        problems.append(f"{model_cfg.name} {pcfg.short()}: captured states differ from the analytic ones")
    else:
        for spec in cap.specs:
            for p in range(pcfg.world_size):
                if captured.shards(spec.name, p) != layout.shards(spec.name, p):
                    problems.append(f"{model_cfg.name} {pcfg.short()} position {p} {spec.name}: captured "
                                    f"{captured.shards(spec.name, p)} != analytic {layout.shards(spec.name, p)}")
    for name, param in model.named_parameters():
        state = opt.state[param]
        for state_name, tensor in ((name, param), (name + ".exp_avg", state["exp_avg"]),
                                   (name + ".exp_avg_sq", state["exp_avg_sq"])):
            held = layout.shards(state_name, rank)
            where = f"{model_cfg.name} {pcfg.short()} rank {rank} {state_name}"
            local = tensor.to_local()
            if tensor is not param and (tensor.placements != param.placements
                                        or tensor.device_mesh != param.device_mesh):
                problems.append(f"{where}: placed as {tensor.placements}, its parameter as {param.placements}")
            if tuple(local.shape) != held.local_shape:
                problems.append(f"{where}: local shape {tuple(local.shape)} != analytic {held.local_shape}")
                continue
            shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                                   tensor.placements)
            if tuple(shape) != held.local_shape:
                problems.append(f"{where}: DTensor local shape {tuple(shape)} != analytic {held.local_shape}")
            if len(held.boxes) > 1:
                problems.append(f"{where}: {len(held.boxes)} boxes for an unfused parameter")
            elif held.boxes and tuple(offset) != held.boxes[0].lo:
                problems.append(f"{where}: DTensor offset {tuple(offset)} != analytic {held.boxes[0].lo}")
            if tensor is param:
                # Values settle what metadata cannot: the local data is the analytic box of the whole.
                # (A moment with the same placements on the same mesh is laid out the same way.)
                full = tensor.full_tensor()  # every rank gathers the same tensors in the same order
                for box, off in zip(held.boxes, held.offsets):
                    got = local[box.shift(box.lo).offset(off).slices()]
                    if not torch.equal(got, full[box.slices()]):
                        problems.append(f"{where}: values at {box} differ from the full tensor")
                del full
            checked += 1
            empty += local.numel() == 0
            del local
    del model, opt, state, tensor, param
    gc.collect()
    return problems, checked, empty


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    problems, checked = [], []
    try:
        for model_name, text in CASES:
            model_cfg = TINY if model_name == "tiny" else get_model_config(model_name)
            start = time.perf_counter()
            found, n, empty = check(model_cfg, ParallelConfig.parse(text), rank)
            problems += found
            checked.append([model_cfg.name, text, n, empty, round(time.perf_counter() - start, 2)])
    finally:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump({"rank": rank, "problems": problems, "checked": checked, "pid": os.getpid()}, f)


if __name__ == "__main__":
    main()
