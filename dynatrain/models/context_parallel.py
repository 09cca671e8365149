"""Context parallelism: each sample's sequence split over the ``cp`` ranks of a data-parallel rank, attention over
the whole sequence by all-gathering keys and values inside the cp group (the Llama 3 paper's approach).

The split is load-balanced for causal attention: the sequence is cut into ``2 * cp`` equal chunks and cp rank
``i`` holds chunks ``i`` and ``2*cp - 1 - i`` (an early chunk, which attends to few keys, beside a late one, which
attends to many), so every rank does the same attention work. Everything per token follows the split: the
embeddings' rows, the RoPE rotations (by global position), the logits and the labels of the loss. Keys and values
are gathered with torch's functional collectives, whose backward reduce-scatters the gradients back to the rank
that made them; they run on gloo and NCCL and leave the attention kernel free (torch's ring attention,
`context_parallel`, fails on CPU: PLATFORM-NOTES). The mask compares global positions, so the gathered keys need
no reordering.

The loss of one rank is the mean over its tokens; every rank of a cp group holds as many tokens, so the mean of
those means, which FSDP's gradient reduction over ``dp_shard x cp`` takes, is the mean over the sequence.

A model of your own is cp-aware when its parallelisation calls `enable_context_parallel(model, mesh["cp"])` and its
forward uses the returned `ContextParallel`: ``cp.shard(tokens)`` (and the labels: ``cp.shard(labels)``),
``cp.shard(rope_table[:seq_len], dim=0)`` for positional tables, and ``cp.attention(q, k, v)`` in place of causal
`scaled_dot_product_attention`. A layout with cp > 1 refuses a model that has none (`check_context_parallel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CP_ATTR = "context_parallel"  # where a cp-aware module keeps its `ContextParallel` (a plain attribute)


class ContextParallel:
    """One rank's place in its cp group: how to split sequences, and attention over the gathered keys and values.

    Holds the cp sub-mesh, not a process group: a target layout is built on meta with probe meshes whose groups
    must not be asked for until a forward runs."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.size = mesh.size()
        # From the mesh's coordinates, not its group: a probe mesh has no usable group.
        self.rank = mesh.get_coordinate()[0]
        self._mask: tuple | None = None

    def chunks(self) -> tuple[int, int]:
        """The indices, among the sequence's ``2 * size`` chunks, of the two this rank holds."""
        return self.rank, 2 * self.size - 1 - self.rank

    def chunk_len(self, seq_len: int) -> int:
        if seq_len % (2 * self.size):
            raise ValueError(
                f"cp={self.size} splits each sequence into 2*cp = {2 * self.size} equal chunks, and the sequence "
                f"length {seq_len} is not a multiple of {2 * self.size}: choose a sequence length that is, or a "
                "smaller cp")
        return seq_len // (2 * self.size)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of ``x`` along ``dim`` (the whole sequence), concatenated in order."""
        c = self.chunk_len(x.shape[dim])
        first, second = self.chunks()
        return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim=dim)

    def positions(self, local_len: int, rank: int | None = None, device=None) -> torch.Tensor:
        """Global positions of the ``local_len`` tokens a rank (this one by default) holds."""
        c = local_len // 2
        r = self.rank if rank is None else rank
        starts = (r, 2 * self.size - 1 - r)
        return torch.cat([torch.arange(s * c, (s + 1) * c, device=device) for s in starts])

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys and values. ``q``, ``k``, ``v``:
        ``(batch, heads, local_len, head_dim)`` of this rank's tokens (grouped-query heads allowed)."""
        k_all, v_all = self._gather(k), self._gather(v)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=self.mask(q.shape[2], q.device),
                                              enable_gqa=q.shape[1] != k.shape[1])

    def mask(self, local_len: int, device) -> torch.Tensor:
        """Which of the gathered keys (every rank's, in rank order) each of this rank's queries may see: those at
        or before its global position. One tensor for every layer and step (it is saved for backward: one copy)."""
        key = (local_len, str(device))
        if self._mask is None or self._mask[0] != key:
            q_pos = self.positions(local_len, device=device)
            k_pos = torch.cat([self.positions(local_len, r, device=device) for r in range(self.size)])
            self._mask = (key, k_pos[None, :] <= q_pos[:, None])
        return self._mask[1]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the cp group, without gradient: a statistic of the whole sequence that is a sum over
        its tokens (a router's token counts)."""
        import torch.distributed as dist

        out = x.detach().clone()
        dist.all_reduce(out, group=self.mesh.get_group())
        return out

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of every cp rank, concatenated along the sequence (dim 2) in rank order; gradients flow back."""
        from torch.distributed._functional_collectives import all_gather_single_autograd

        # The autograd all-gather concatenates along dim 0 only: put the sequence there and back.
        seq_first = x.movedim(2, 0).contiguous()
        gathered = all_gather_single_autograd(seq_first, 0, self.mesh.get_group())
        return gathered.movedim(0, 2)


def enable_context_parallel(module: nn.Module, cp_mesh) -> ContextParallel | None:
    """Make ``module`` cp-aware on ``cp_mesh`` (the layout's ``mesh["cp"]``) and return its `ContextParallel` (None
    when the cp group has one rank: nothing is split). The module's forward must use it (see the module
    docstring)."""
    if cp_mesh is None or cp_mesh.size() == 1:
        return None
    cp = ContextParallel(cp_mesh)
    module.__dict__[CP_ATTR] = cp  # not a submodule: adds no parameter name, and pipeline views copy it
    return cp


def context_parallel_of(module: nn.Module) -> ContextParallel | None:
    """The `ContextParallel` of ``module`` or of the first cp-aware module inside it, else None."""
    for m in module.modules():
        cp = m.__dict__.get(CP_ATTR)
        if cp is not None:
            return cp
    return None


def shard_labels(module: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """The labels of the tokens this rank computes: split as the cp-aware model inside ``module`` splits its
    inputs, unchanged without context parallelism."""
    cp = context_parallel_of(module)
    return labels if cp is None else cp.shard(labels)


def check_context_parallel(module: nn.Module, layout) -> None:
    """Refuse a layout with cp > 1 for a module whose parallelisation made nothing cp-aware: its attention would
    see a part of each sequence only, and train on wrong values without an error."""
    # No layout yet: Lightning's unit tests call setup() without setup_environment(), which resolves it.
    if layout is None or layout.cp == 1 or context_parallel_of(module) is not None:
        return
    from dynatrain.vps.parallel_config import LayoutError

    raise LayoutError(
        f"{layout.short()} splits each sequence over cp={layout.cp} ranks, but the attention of "
        f"{type(module).__name__} is not cp-aware: call dynatrain.models.context_parallel.enable_context_parallel("
        "model, device_mesh['cp']) in configure_model() and use its shard() and attention() in the forward "
        "(docs/context_parallel.md), or use cp=1")
