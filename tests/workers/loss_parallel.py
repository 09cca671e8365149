"""One rank of a tp=2 check: the zoo's model with its logits split over the vocabulary and the loss computed under
`loss_parallel` gives the loss and gradients of the same model whose logits are gathered whole."""

import argparse
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from dynatrain.launch.local import finish_rank
from dynatrain.lm.causal_lm import _cross_entropy
from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.models.llama import Transformer
from dynatrain.models.parallelize import ParallelizeOptions, init_mesh, materialize_model
from dynatrain.models.parallelize_dense import parallelize_dense
from dynatrain.vps.parallel_config import ParallelConfig

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", default="tp=2")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    pcfg = ParallelConfig.parse(args.layout)
    mesh = init_mesh(pcfg)
    cfg = MODEL_CONFIGS["debug"]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (2, 32), generator=gen)
    result = {}
    for split in (False, True):
        with torch.device("meta"):
            model = Transformer(cfg)
        parallelize_dense(model, mesh, pcfg, ParallelizeOptions(loss_parallel=split))
        materialize_model(model, "cpu")
        logits = model(tokens)
        loss = _cross_entropy(logits, labels)
        with loss_parallel():
            loss.backward()
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
        result["split" if split else "gathered"] = {
            "logits_split": isinstance(logits, DTensor) and not logits.placements[0].is_replicate(),
            "loss": loss.item(), "grads": {n: g.double().norm().item() for n, g in grads.items()},
        }
        result.setdefault("_grads", []).append(grads)
    a, b = result.pop("_grads")
    result["max_grad_rel_diff"] = max(((a[n] - b[n]).norm() / a[n].norm().clamp_min(1e-30)).item() for n in a)
    dist.destroy_process_group()
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
