"""One rank of a context-parallel check: the zoo's model parallelised for a cp layout (sequences split over the cp
ranks, keys and values all-gathered, FSDP over dp_shard x cp) gives the logits, loss and gradients of the same
model run whole on every rank; a mixture of experts also its auxiliary loss (in the loss) and its routers' token
counts."""

import argparse
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dynatrain.launch.local import finish_rank
from dynatrain.lm.causal_lm import _cross_entropy
from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.models.context_parallel import context_parallel_of, shard_labels
from dynatrain.models.llama import Transformer
from dynatrain.models.moe import MoETransformer
from dynatrain.models.moe_configs import MOE_CONFIGS
from dynatrain.models.parallelize import init_mesh, materialize_model
from dynatrain.models.parallelize_dense import parallelize_dense
from dynatrain.models.parallelize_moe import parallelize_moe
from dynatrain.vps.parallel_config import ParallelConfig

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", default="cp=2")
    ap.add_argument("--model", default="debug", choices=["debug", "moe-debug"])
    args = ap.parse_args()
    moe = args.model == "moe-debug"
    cfg = MOE_CONFIGS[args.model] if moe else MODEL_CONFIGS["debug"].with_overrides(n_layers=2)
    build = MoETransformer if moe else Transformer
    tokens, labels = torch.randint(0, cfg.vocab_size, (2, 2, 32), generator=torch.Generator().manual_seed(0))
    pcfg = ParallelConfig.parse(args.layout)
    dist.init_process_group("gloo")
    mesh = init_mesh(pcfg)

    whole = build(cfg)
    whole.init_weights()
    full_logits = whole(tokens)
    full_aux = whole.aux_loss() if moe else torch.zeros(())
    full_loss = _cross_entropy(full_logits, labels) + full_aux
    full_loss.backward()

    with torch.device("meta"):
        model = build(cfg)
    (parallelize_moe if moe else parallelize_dense)(model, mesh, pcfg)
    materialize_model(model, "cpu")
    cp = context_parallel_of(model)
    logits = model(tokens)
    aux = model.aux_loss() if moe else torch.zeros(())
    loss = _cross_entropy(logits, shard_labels(model, labels)) + aux
    loss.backward()
    # The unsplit figures are the means over the ranks (losses) and the sums (token counts).
    counts = [layer.moe.tokens_per_expert for layer in model.layers.values()] if moe else []
    figures = torch.stack([loss.detach(), aux.detach(), *[c.sum() for c in counts]])
    figures = torch.cat([figures, *counts]) if moe else figures
    dist.all_reduce(figures)
    mean_loss, mean_aux = figures[0] / dist.get_world_size(), figures[1] / dist.get_world_size()
    whole_counts = torch.cat([layer.moe.tokens_per_expert for layer in whole.layers.values()]) if moe else None
    rel = {}
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        rel[name] = ((grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item()
    finish_rank(args.out, {
        "cp_rank": cp.rank, "local_len": logits.shape[1],
        "logits_max_abs_diff": (logits - cp.shard(full_logits)).abs().max().item(),
        "loss_rel_diff": abs(mean_loss.item() - full_loss.item()) / full_loss.item(),
        "max_grad_rel_diff": max(rel.values()), "params": len(rel),
        "aux": full_aux.item(), "aux_rel_diff": abs(mean_aux.item() - full_aux.item()) / max(full_aux.item(), 1e-30),
        "counts_equal": None if whole_counts is None else
        torch.equal(figures[2 + len(counts):], whole_counts),
        "local_counts_sum": figures[2:2 + len(counts)].tolist() if moe else None,
    })


if __name__ == "__main__":
    main()
