"""The decoder stack every kind of the zoo shares: token embedding, blocks, final RMSNorm, output projection and the
RoPE table, and the parts a block is made of (RMSNorm, rotary embeddings, grouped-query attention, the SwiGLU
feed-forward). A kind differs only by its block (`models.llama`: dense, `models.moe`: mixture of experts).

Knows nothing of parallelism but what a forward must do differently: under tensor parallelism the projections hold
a slice of the heads, so head counts are read from the local weight shapes at run time, never from the config;
under context parallelism (a `ContextParallel` that a kind's parallelisation attaches, `models.context_parallel`)
the model takes whole sequences, computes the tokens of its cp rank only, and its attention sees every key of the
sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dynatrain.models.context_parallel import CP_ATTR
from dynatrain.models.init import init_slice, init_std


def precompute_freqs_cis(head_dim: int, seq_len: int, theta: float, device=None) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    return torch.polar(torch.ones(seq_len, head_dim // 2, device=device), torch.outer(t, freqs))


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    # x: (batch, seq, heads, head_dim); rotate consecutive pairs as complex numbers.
    def rotate(x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        fc = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, xc.shape[-1])
        return torch.view_as_real(xc * fc).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


class Attention(nn.Module):
    """GQA attention with RoPE; ``qk_norm`` adds a per-head RMSNorm of queries and keys (Qwen3)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool = False,
                 norm_eps: float = 1e-5):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cp = self.__dict__.get(CP_ATTR)
        if cp is not None:
            out = cp.attention(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Decoder(nn.Module):
    """Embedding, ``cfg.n_layers`` blocks made by ``block(cfg)``, final norm and output projection; RoPE over
    ``head_dim``. A kind subclasses it with its block; parameter names are the same for every kind
    (``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``)."""

    def __init__(self, cfg, block: Callable[[object], nn.Module], head_dim: int):
        super().__init__()
        self.config = cfg
        self.rope_head_dim = head_dim
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keeps names "layers.<i>" stable, the same as torchtitan's checkpoints.
        self.layers = nn.ModuleDict({str(i): block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("freqs_cis", self._freqs_cis(), persistent=False)

    def _freqs_cis(self, device=None) -> torch.Tensor:
        c = self.config
        return precompute_freqs_cis(self.rope_head_dim, c.max_seq_len, c.rope_theta, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds some of the parts (`models.pipeline_split`): a later stage takes hidden states in, an
        # earlier one hands them on.
        tokens, freqs_cis = cp_split(self, tokens, self.freqs_cis)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter (plain or DTensor) with its layout-independent initial value, then the buffers."""
        cfg = self.config
        init_parameters(self, cfg.dim, cfg.n_layers, cfg.init_seed)
        self.init_buffers(buffer_device or self.freqs_cis.device)

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the non-persistent buffers (after `to_empty`)."""
        self.freqs_cis = self._freqs_cis(device=device)


def cp_split(model: nn.Module, tokens: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder's input and RoPE table for this rank's tokens: unchanged without context parallelism; with it,
    whole sequences come in on the first stage (``model.tok_embeddings`` present), and from there on every tensor
    holds this rank's tokens, rotated by their global positions."""
    cp = model.__dict__.get(CP_ATTR)
    if cp is None:
        return tokens, freqs_cis
    tokens = cp.shard(tokens) if model.tok_embeddings is not None else tokens
    return tokens, cp.shard(freqs_cis[: tokens.shape[1] * cp.size], dim=0)


@torch.no_grad()
def init_parameters(module: nn.Module, dim: int, n_layers: int, seed: int) -> None:
    """Fill every parameter of ``module`` (plain or DTensor) with its layout-independent initial value: each rank
    draws only the rows of its own box (`models.init`); an expert is one row of its stacked tensor."""
    for name, param in module.named_parameters():
        local = local_tensor(param)
        shape, offset = _local_box(param)
        value = init_slice(name, tuple(param.shape), offset, shape, init_std(name, dim, n_layers), seed)
        local.copy_(value.reshape(local.shape))


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param`` (itself when it is not a DTensor)."""
    return param.to_local() if hasattr(param, "to_local") else param


def _local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not hasattr(param, "device_mesh"):
        return tuple(param.shape), (0,) * param.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if not offset:  # a rank outside the mesh holds nothing
        return (0,) * param.dim(), (0,) * param.dim()
    return tuple(shape), tuple(offset)
