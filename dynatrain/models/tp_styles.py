"""Which tensor-parallel style each parameter takes.

One table read by both the real parallelisation (`parallelize.apply_tp`) and the analytic layout
(`vps.rules`), so the two cannot drift apart.
"""

from __future__ import annotations

COLWISE = "colwise"      # nn.Linear weight [out, in] sharded on dim 0
ROWWISE = "rowwise"      # nn.Linear weight [out, in] sharded on dim 1
EMBEDDING = "embedding"  # nn.Embedding weight [vocab, dim] sharded on dim 0 (rowwise embedding)
REPLICATE = "replicate"  # norms

# Keys are module suffixes inside a transformer block, or top-level module names.
BLOCK_PLAN: dict[str, str] = {
    "attention.wq": COLWISE,
    "attention.wk": COLWISE,
    "attention.wv": COLWISE,
    "attention.wo": ROWWISE,
    "feed_forward.w1": COLWISE,
    "feed_forward.w2": ROWWISE,
    "feed_forward.w3": COLWISE,
    "attention_norm": REPLICATE,
    "ffn_norm": REPLICATE,
}
# The mixture-of-experts block: attention as above; the router, the shared and routed experts and the q/k norms
# are not in it, so they stay whole on every TP rank (each TP rank routes the same tokens).
MOE_BLOCK_PLAN: dict[str, str] = {k: v for k, v in BLOCK_PLAN.items() if not k.startswith("feed_forward.")}
TOP_PLAN: dict[str, str] = {
    "tok_embeddings": EMBEDDING,
    "norm": REPLICATE,
    "output": COLWISE,
}

SHARD_DIM = {COLWISE: 0, ROWWISE: 1, EMBEDDING: 0, REPLICATE: None}


def tp_style(param_name: str, block_plan: dict[str, str] = BLOCK_PLAN) -> str:
    """The TP style of a parameter given its full name (e.g. ``layers.3.attention.wq.weight``)."""
    module = param_name.rsplit(".", 1)[0]
    if module in TOP_PLAN:
        return TOP_PLAN[module]
    parts = module.split(".")
    if len(parts) >= 3 and parts[0] == "layers":
        suffix = ".".join(parts[2:])
        if suffix in block_plan:
            return block_plan[suffix]
    raise KeyError(f"no tensor-parallel rule for parameter {param_name!r}")


def tp_shard_dim(param_name: str) -> int | None:
    """The dimension TP shards for this parameter, or None when it is replicated across TP ranks."""
    return SHARD_DIM[tp_style(param_name)]


def moe_tp_shard_dim(param_name: str) -> int | None:
    """As `tp_shard_dim` for the mixture-of-experts model: a parameter outside its plan is whole on every TP rank."""
    try:
        return SHARD_DIM[tp_style(param_name, MOE_BLOCK_PLAN)]
    except KeyError:
        return None
