"""Named Llama-family shapes.

Pure Python (no torch): the planners size 70B models from these without building anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class ModelConfig:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048
    init_seed: int = 0

    def __post_init__(self) -> None:
        for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"model {self.name!r}: {field} must be positive, got {getattr(self, field)}")
        if self.dim % self.n_heads:
            raise ValueError(f"model {self.name!r}: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model {self.name!r}: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's global shape, in the model's registration order, with torchtitan's names."""
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (self.vocab_size, self.dim)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            shapes.update(attention_shapes(p + "attention.", self.dim, self.n_heads, self.n_kv_heads, self.head_dim))
            shapes.update(swiglu_shapes(p + "feed_forward.", self.dim, self.ffn_dim))
            shapes.update(block_norm_shapes(p, self.dim))
        shapes.update(head_shapes(self.dim, self.vocab_size))
        return shapes

    def num_params(self) -> int:
        return sum(numel(s) for s in self.param_shapes().values())

    def to_dict(self) -> dict:
        return asdict(self)

    def with_overrides(self, **overrides) -> "ModelConfig":
        return with_overrides(self, overrides)


def attention_shapes(prefix: str, dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
                     qk_norm: bool = False) -> dict[str, tuple[int, ...]]:
    """The GQA attention's parameters (`decoder.Attention`), in registration order."""
    shapes = {prefix + "wq.weight": (n_heads * head_dim, dim), prefix + "wk.weight": (n_kv_heads * head_dim, dim),
              prefix + "wv.weight": (n_kv_heads * head_dim, dim), prefix + "wo.weight": (dim, n_heads * head_dim)}
    if qk_norm:
        shapes.update({prefix + "q_norm.weight": (head_dim,), prefix + "k_norm.weight": (head_dim,)})
    return shapes


def swiglu_shapes(prefix: str, dim: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU feed-forward's parameters (`decoder.FeedForward`)."""
    return {prefix + "w1.weight": (hidden, dim), prefix + "w2.weight": (dim, hidden), prefix + "w3.weight": (hidden, dim)}


def block_norm_shapes(prefix: str, dim: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "attention_norm.weight": (dim,), prefix + "ffn_norm.weight": (dim,)}


def head_shapes(dim: int, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """The final norm and the output projection."""
    return {"norm.weight": (dim,), "output.weight": (vocab_size, dim)}


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def with_overrides(config, overrides: dict):
    """``config`` (a dataclass) with some fields replaced; an unknown field is named with the known ones."""
    unknown = sorted(set(overrides) - {f.name for f in fields(config)})
    if unknown:
        raise ValueError(f"unknown model field(s) {unknown} in model_overrides; known: "
                         f"{[f.name for f in fields(config)]}")
    return replace(config, **overrides)


MODEL_CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        # vocab 512 holds the byte tokenizer's 256 bytes plus specials, padded so tp up to 8 divides it.
        ModelConfig("debug", dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, ffn_dim=768,
                    max_seq_len=512),
        ModelConfig("125m", dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000, ffn_dim=2048),
        ModelConfig("350m", dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, vocab_size=32000, ffn_dim=2816),
        ModelConfig("1b", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_dim=8192),
        ModelConfig("llama3-8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                    ffn_dim=14336, max_seq_len=8192),
        ModelConfig("llama3-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                    ffn_dim=28672, max_seq_len=8192),
        ModelConfig("llama3-405b", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                    ffn_dim=53248, max_seq_len=8192),
    )
}


def get_model_config(name: str | ModelConfig) -> ModelConfig:
    if isinstance(name, ModelConfig):
        return name
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_CONFIGS)}") from None
