"""Per-kind terms of the layout policy's cost model: what a block of the zoo's dense model (`models.llama`) or
mixture-of-experts model (`models.moe`) keeps for backward per token, and what its checkpointing recomputes. They
live beside the models because they follow each block's code; the policy (`policy.memory_model`,
`policy.step_model`) reaches them through `models.registry` and adds what every kind shares (formulas in
docs/layouts.md)."""

from __future__ import annotations

from typing import Protocol

from dynatrain.models.configs import ModelConfig
from dynatrain.models.moe_configs import MoEConfig
from dynatrain.vps.layout import DTYPE_ITEMSIZE


class TokenWork(Protocol):
    """What these terms read of the policy's `Workload` (this layer sits below the policy and cannot import it)."""

    compute_dtype: str
    seq_len: int
    sequence_parallel: bool
    fused_attention: bool


def gathered_inputs(model: ModelConfig | MoEConfig, work: TokenWork, tp: int) -> float:
    # Under sequence parallelism the attention's and the FFN's inputs are all-gathered over the sequence, and the
    # first matmul of each keeps that whole tensor for its weight gradient: replicated on every TP rank.
    return 2 * DTYPE_ITEMSIZE[work.compute_dtype] * model.dim if work.sequence_parallel and tp > 1 else 0.0


# ---- dense ----------------------------------------------------------------------------------------------------
def dense_layer_bytes(model: ModelConfig, work: TokenWork, tp: int) -> tuple[float, float]:
    """(one block's, the final norm's) activation bytes per token of the dense model without checkpointing: what
    autograd saves for the block in dynatrain/models/llama.py (see docs/layouts.md)."""
    e = DTYPE_ITEMSIZE[work.compute_dtype]
    h, f, s = model.dim, model.ffn_dim, work.seq_len
    kv = model.n_kv_heads * model.head_dim
    # Each RMSNorm keeps its fp32 upcast and its output; both are replicated over the TP group unless
    # sequence parallelism shards them.
    norms = 2 * (4 + e) * h / (tp if work.sequence_parallel else 1)
    # q, k, v and the attention output; RoPE's fp32 complex copies of q and k; SwiGLU's w1 and w3 outputs,
    # silu and the product. All TP-sharded.
    sharded = (e * (2 * h + 2 * kv) + 4 * (h + kv) + 4 * e * f) / tp
    # Without a fused kernel the scores and the softmax of every head are kept: a row of seq_len per head.
    scores = 0 if work.fused_attention else 2 * e * model.n_heads * s / tp
    final_norm = (4 + e) * h / (tp if work.sequence_parallel else 1)
    return norms + sharded + scores + gathered_inputs(model, work, tp), final_norm


def dense_op_saved_bytes(model: ModelConfig, work: TokenWork, tp: int, per_layer: float) -> float:
    """Bytes per token a block checkpointed per op keeps (`models.checkpointing`): the outputs of the 1st, 3rd,
    5th and 7th matmul (wq, wv, w1, w2; w2's is whole, a row-parallel partial sum under TP), of attention (its
    output and fp32 log-sum-exp per head) and, with tp > 1, of the two all-reduces (under sequence parallelism the
    two reduce-scatters, split over the sequence; the all-gathers are recomputed)."""
    e = DTYPE_ITEMSIZE[work.compute_dtype]
    h, kv = model.dim, model.n_kv_heads * model.head_dim
    saved = e * (h + kv + h + model.ffn_dim) / tp + 4 * model.n_heads / tp + e * h
    return saved + (2 * e * h / (tp if work.sequence_parallel else 1) if tp > 1 else 0.0)


def dense_op_recompute_fraction(model: ModelConfig) -> float:
    """The share of a block's forward FLOPs the op policy runs again: the matmuls it does not keep (wk, wo, w3),
    attention kept."""
    h, f, kv = model.dim, model.ffn_dim, model.n_kv_heads * model.head_dim
    return (h * kv + h * h + h * f) / (2 * h * h + 2 * h * kv + 3 * h * f)


def dense_attention_width(model: ModelConfig) -> int:
    return model.dim


# ---- mixture of experts -------------------------------------------------------------------------------------
def moe_layer_bytes(model: MoEConfig, work: TokenWork, tp: int) -> tuple[float, float]:
    """As `dense_layer_bytes`, for the MoE block of dynatrain/models/moe.py: attention as the dense block
    (TP-sharded), then the router's fp32 scores, the ``top_k`` copies of the token sent to its experts (and
    received back), each expert's SwiGLU intermediates, and the shared expert's; none of the MoE part is split
    over TP (every TP rank routes the same tokens)."""
    e = DTYPE_ITEMSIZE[work.compute_dtype]
    h, s, k = model.dim, work.seq_len, model.top_k
    q = model.n_heads * model.attn_head_dim
    kv = model.n_kv_heads * model.attn_head_dim
    norms = 2 * (4 + e) * h / (tp if work.sequence_parallel else 1)
    attention = (e * (2 * q + 2 * kv) + 4 * (q + kv)) / tp
    scores = 0 if work.fused_attention else 2 * e * model.n_heads * s / tp
    router = 4 * 2 * model.n_experts
    routed = k * (2 * e * h + 4 * e * model.moe_ffn_dim)
    shared = 4 * e * model.shared_ffn_dim
    final_norm = (4 + e) * h / (tp if work.sequence_parallel else 1)
    return norms + attention + scores + router + routed + shared + gathered_inputs(model, work, tp), final_norm


def moe_op_saved_bytes(model: MoEConfig, work: TokenWork, tp: int, per_layer: float) -> float:
    # A MoE block's matmul count depends on the routing: the op policy is taken to keep half its activations.
    return per_layer / 2


def moe_op_recompute_fraction(model: MoEConfig) -> float:
    return 0.5  # half a MoE block, as `moe_op_saved_bytes` keeps half


def moe_attention_width(model: MoEConfig) -> int:
    return model.n_heads * model.attn_head_dim  # Qwen3 sets head_dim apart from dim
