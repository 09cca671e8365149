"""Expert parallelism as a ParallelStyle: the routed experts of one MoE layer split over the ``ep`` ranks.

The experts module takes tokens sorted by expert and the count each expert gets (`GroupedExperts.forward`). Around
it this style sends every token to the rank that holds its expert and brings the results back, with
``all_to_all_single`` (the autograd version, so the backward sends the gradients the same way in reverse). The
model's code does not change: the style wraps the module's input and output, as tensor parallelism does.

Per layer, per forward:
1. the ranks swap their per-expert token counts (a small all-to-all, no gradient);
2. tokens go out in the order they arrive (expert-major, so each destination gets one contiguous piece) and come
   in ordered by (source rank, local expert); they are regrouped to (local expert, source rank) for the grouped
   matmul, and the counts summed over the sources;
3. after the experts, the inverse regrouping and the reverse all-to-all return each token's result to its source.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class ExpertParallel(ParallelStyle):
    """``Shard(0)`` of every parameter of the wrapped experts over a 1-D ep mesh, tokens moved by all-to-all.
    One instance per experts module: it keeps the splits of the forward for the combine."""

    def __init__(self) -> None:
        super().__init__()
        self._splits: tuple[list[int], list[int]] | None = None
        self._regroup: torch.Tensor | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"expert parallelism needs a 1-D ep mesh, got {device_mesh}")
        ep = device_mesh.size()
        for name, param in module.named_parameters(recurse=False):
            if param.shape[0] % ep:
                raise ValueError(f"ep={ep} does not divide the {param.shape[0]} experts of {name!r}: choose an ep "
                                 f"that divides {param.shape[0]}")
        return distribute_module(module, device_mesh, partition_fn=self._partition, input_fn=self._dispatch,
                                 output_fn=self._combine)

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
            module.register_parameter(key, sharded)

    def _dispatch(self, module: nn.Module, inputs, mesh: DeviceMesh):
        tokens, counts = inputs
        group = mesh.get_group()
        ep = mesh.size()
        local = counts.numel() // ep
        with torch.no_grad():
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts.contiguous(), group=group)
        send = counts.view(ep, local).sum(1).tolist()
        received = received.view(ep, local)  # [source rank, local expert]
        recv = received.sum(1).tolist()
        self._splits = (send, recv)
        routed = all_to_all_single_autograd(tokens.contiguous(), recv, send, group)
        self._regroup = _expert_major(received)
        return routed[self._regroup], received.sum(0)

    def _combine(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        assert self._splits is not None and self._regroup is not None, "combine without a dispatch"
        send, recv = self._splits
        back = torch.empty_like(output).index_copy(0, self._regroup, output)
        self._splits = self._regroup = None
        return all_to_all_single_autograd(back, send, recv, mesh.get_group())


def _expert_major(received: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder tokens arranged by (source, expert) blocks, sizes ``received[s, e]``, into
    (expert, source) order."""
    sizes = received.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    by_expert = received.t().reshape(-1)
    starts_by_expert = starts.view(received.shape).t().reshape(-1)
    # Each (expert, source) block is a run starting at its (source, expert) offset.
    device = received.device
    block = torch.repeat_interleave(torch.arange(by_expert.numel(), device=device), by_expert)
    first = torch.cumsum(by_expert, 0) - by_expert
    return starts_by_expert[block] + torch.arange(block.numel(), device=device) - first[block]
