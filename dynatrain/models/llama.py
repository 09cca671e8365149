"""The dense kind: the Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU), the shared stack of
`models.decoder` with a block of attention and one feed-forward. No parallelism inside
(`models.parallelize_dense` parallelises it)."""

from __future__ import annotations

import torch
from torch import nn

from dynatrain.models.configs import ModelConfig
from dynatrain.models.decoder import Attention, Decoder, FeedForward, RMSNorm


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(Decoder):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, TransformerBlock, cfg.head_dim)
