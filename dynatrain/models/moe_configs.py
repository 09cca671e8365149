"""Named mixture-of-experts shapes (Qwen3-MoE, Mixtral and CPU-sized ones).

Pure Python (no torch): planners size a 235B model from these without building anything. Routed experts are
stacked per layer (``w1``, ``w3``: ``[E, moe_ffn_dim, dim]``; ``w2``: ``[E, dim, moe_ffn_dim]``), the shape
expert parallelism shards on dim 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dynatrain.models.configs import (
    attention_shapes,
    block_norm_shapes,
    head_shapes,
    numel,
    swiglu_shapes,
    with_overrides,
)

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    n_experts: int
    top_k: int
    moe_ffn_dim: int
    head_dim: int = 0  # 0: dim // n_heads (Qwen3 sets it apart from dim)
    shared_ffn_dim: int = 0  # 0: no shared expert
    score_func: str = "softmax"
    route_norm: bool = True  # renormalise the top-k weights to sum to 1
    load_balance_coeff: float = 1e-3  # auxiliary load-balancing loss; 0 turns it off
    bias_update_rate: float = 0.0  # auxiliary-loss-free balancing (expert bias); 0 turns it off
    qk_norm: bool = False
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 2048
    init_seed: int = 0

    def __post_init__(self) -> None:
        for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "n_experts", "top_k", "moe_ffn_dim",
                      "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"model {self.name!r}: {field} must be positive, got {getattr(self, field)}")
        if self.top_k > self.n_experts:
            raise ValueError(f"model {self.name!r}: top_k={self.top_k} is larger than n_experts={self.n_experts}: "
                             f"choose top_k <= {self.n_experts}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model {self.name!r}: n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if not self.head_dim and self.dim % self.n_heads:
            raise ValueError(f"model {self.name!r}: dim={self.dim} is not divisible by n_heads={self.n_heads}: "
                             "give head_dim")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"model {self.name!r}: score_func={self.score_func!r}; choose one of {SCORE_FUNCS}")
        if self.shared_ffn_dim < 0 or self.load_balance_coeff < 0 or self.bias_update_rate < 0:
            raise ValueError(f"model {self.name!r}: shared_ffn_dim, load_balance_coeff and bias_update_rate must "
                             "not be negative")

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's global shape, in the model's registration order."""
        hd, e, f = self.attn_head_dim, self.n_experts, self.moe_ffn_dim
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (self.vocab_size, self.dim)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            shapes.update(attention_shapes(p + "attention.", self.dim, self.n_heads, self.n_kv_heads, hd, self.qk_norm))
            shapes[p + "moe.router.gate.weight"] = (e, self.dim)
            shapes[p + "moe.experts.w1"] = (e, f, self.dim)
            shapes[p + "moe.experts.w2"] = (e, self.dim, f)
            shapes[p + "moe.experts.w3"] = (e, f, self.dim)
            if self.shared_ffn_dim:
                shapes.update(swiglu_shapes(p + "moe.shared_expert.", self.dim, self.shared_ffn_dim))
            shapes.update(block_norm_shapes(p, self.dim))
        shapes.update(head_shapes(self.dim, self.vocab_size))
        return shapes

    def num_params(self) -> int:
        return sum(numel(s) for s in self.param_shapes().values())

    def active_params(self) -> int:
        """Parameters one token passes through: every routed expert's share is top_k / n_experts."""
        total = 0
        for name, shape in self.param_shapes().items():
            n = numel(shape)
            total += n * self.top_k // self.n_experts if ".moe.experts." in name else n
        return total

    def to_dict(self) -> dict:
        return asdict(self)

    def with_overrides(self, **overrides) -> "MoEConfig":
        return with_overrides(self, overrides)


MOE_CONFIGS: dict[str, MoEConfig] = {
    c.name: c
    for c in (
        # CPU-sized: 8 experts, top-2, a shared expert and both balancing methods, vocab for the byte tokenizer.
        MoEConfig("moe-debug", dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512, n_experts=8, top_k=2,
                  moe_ffn_dim=128, shared_ffn_dim=128, bias_update_rate=1e-3, max_seq_len=512),
        MoEConfig("moe-small", dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=32000, n_experts=16,
                  top_k=2, moe_ffn_dim=512, shared_ffn_dim=512),
        # Published shapes (Qwen3 technical report and model cards; Mixtral of Experts, 2024).
        MoEConfig("qwen3-30b-a3b", dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                  vocab_size=151936, n_experts=128, top_k=8, moe_ffn_dim=768, qk_norm=True, max_seq_len=32768),
        MoEConfig("qwen3-235b-a22b", dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
                  vocab_size=151936, n_experts=128, top_k=8, moe_ffn_dim=1536, qk_norm=True, max_seq_len=32768),
        MoEConfig("mixtral-8x7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, n_experts=8,
                  top_k=2, moe_ffn_dim=14336, norm_eps=1e-5, max_seq_len=32768),
    )
}


def get_moe_config(name: str | MoEConfig) -> MoEConfig:
    if isinstance(name, MoEConfig):
        return name
    try:
        return MOE_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown mixture-of-experts model {name!r}; choose one of {', '.join(MOE_CONFIGS)}") from None
