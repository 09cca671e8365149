"""One rank of a context-parallel check: the zoo's model parallelised for a cp layout (sequences split over the cp
ranks, keys and values all-gathered, FSDP over dp_shard x cp) gives the logits, loss and gradients of the same
model run whole on every rank."""

import argparse
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dynatrain.launcher import finish_rank
from dynatrain.llama_lm import _cross_entropy
from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.models.context_parallel import context_parallel_of, shard_labels
from dynatrain.models.llama import Transformer
from dynatrain.models.parallelize import init_mesh, materialize_model, parallelize_llama
from dynatrain.vps.parallel_config import ParallelConfig

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", default="cp=2")
    args = ap.parse_args()
    cfg = MODEL_CONFIGS["debug"].with_overrides(n_layers=2)
    tokens, labels = torch.randint(0, cfg.vocab_size, (2, 2, 32), generator=torch.Generator().manual_seed(0))
    pcfg = ParallelConfig.parse(args.layout)
    dist.init_process_group("gloo")
    mesh = init_mesh(pcfg)

    whole = Transformer(cfg)
    whole.init_weights()
    full_logits = whole(tokens)
    full_loss = _cross_entropy(full_logits, labels)
    full_loss.backward()

    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize_llama(model, mesh, pcfg)
    materialize_model(model, "cpu")
    cp = context_parallel_of(model)
    logits = model(tokens)
    loss = _cross_entropy(logits, shard_labels(model, labels))
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= dist.get_world_size()
    rel = {}
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        rel[name] = ((grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item()
    finish_rank(args.out, {
        "cp_rank": cp.rank, "local_len": logits.shape[1],
        "logits_max_abs_diff": (logits - cp.shard(full_logits)).abs().max().item(),
        "loss_rel_diff": abs(mean_loss.item() - full_loss.item()) / full_loss.item(),
        "max_grad_rel_diff": max(rel.values()), "params": len(rel),
    })


if __name__ == "__main__":
    main()
