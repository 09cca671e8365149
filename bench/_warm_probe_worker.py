"""One process of `bench/first_step.py --probe`: can DTensor's sharding propagation be paid before a first step?

Two tensor-parallel copies of the model on the same ``tp`` mesh: a real one on CPU and one on the meta device. With
``--warm main`` (or ``thread``) the meta copy runs a forward and backward first, on the main thread (or another
one); then the real copy runs ``--steps`` forward and backward passes. Records each pass's wall time and how many
times DTensor's dispatch fell back to its Python sharding propagation (a miss of its C++ cache).
"""

import argparse
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dynatrain.launch.local import finish_rank
from dynatrain.models.configs import get_model_config
from dynatrain.models.llama import Transformer
from dynatrain.models.parallelize import apply_tp, init_mesh
from dynatrain.vps.parallel_config import ParallelConfig


def count_misses() -> list[int]:
    dispatcher, misses = DTensor._op_dispatcher, [0]
    slow_path = dispatcher._propagate_op_sharding_dispatch_slow_path

    def counted(*args, **kwargs):
        misses[0] += 1
        return slow_path(*args, **kwargs)

    dispatcher._propagate_op_sharding_dispatch_slow_path = counted
    return misses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--warm", choices=("none", "main", "thread"), required=True)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    tp_mesh = init_mesh(ParallelConfig.parse(f"tp={dist.get_world_size()}"))["tp"]
    cfg = get_model_config(args.model)
    misses = count_misses()

    def build(device: str) -> Transformer:
        with torch.device("meta"):
            model = Transformer(cfg)
        apply_tp(model, tp_mesh)
        if device != "meta":
            model.to_empty(device=device)
            model.init_weights()
        return model

    def forward_backward(model: Transformer, device: str) -> None:
        tokens = torch.randint(0, cfg.vocab_size, (1, args.seq_len), device=device)
        F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten()).backward()

    real, out = build("cpu"), {"warm": args.warm}
    if args.warm != "none":
        meta, t0 = build("meta"), time.perf_counter()
        if args.warm == "thread":
            worker = threading.Thread(target=forward_backward, args=(meta, "meta"))
            worker.start()
            worker.join()
        else:
            forward_backward(meta, "meta")
        out.update(warm_s=time.perf_counter() - t0, warm_misses=misses[0])
        misses[0] = 0
    out["steps"] = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        forward_backward(real, "cpu")
        out["steps"].append({"s": time.perf_counter() - t0, "misses": misses[0]})
        misses[0] = 0
    finish_rank(args.out, out)


if __name__ == "__main__":
    main()
