"""The baseline a user leaves for dynatrain: the zoo's Llama trained by a hand-written loop on torch alone (FSDP2
`fully_shard`, `torch.compile` per block, `torch.utils.checkpoint` on every n-th block, AdamW), as torchtitan
does it, with no Lightning and none of dynatrain's strategy. Returns the wall time of each optimizer step."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.models.llama import Transformer


class _Checkpointed(torch.nn.Module):
    """Recompute ``block``'s forward in the backward (torch's non-reentrant checkpoint)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, freqs_cis, use_reentrant=False)


def run_loop(model_name: str, steps: int, seq_len: int, micro_batch: int, every: int, backend: str | None,
             lr: float = 3e-3) -> list[float]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    cfg = MODEL_CONFIGS[model_name]
    with torch.device("meta"):
        model = Transformer(cfg)
    for key, block in list(model.layers.items()):
        if every and (int(key) + 1) % every == 0:
            block = _Checkpointed(block)
        if backend:
            block.compile(backend=backend, fullgraph=False)
        model.layers[key] = block
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    ends = [time.perf_counter()]
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:])]
