"""The mixture-of-experts kind (Qwen3-MoE / Mixtral family): the shared stack of `models.decoder` with a block of
attention and an MoE feed-forward. No parallelism inside (`models.parallelize_moe` parallelises it).

Each block is GQA attention (optional per-head q/k norm) and an MoE feed-forward: a token-choice top-k router
(softmax or sigmoid scores, optionally renormalised top-k weights), routed experts stored stacked (``w1``, ``w3``:
``[E, F, D]``, ``w2``: ``[E, D, F]``) and computed in one ``torch._grouped_mm`` over the tokens sorted by expert,
and an optional shared expert every token passes through. Load is balanced by an auxiliary loss
(``aux_loss()``, to add to the training loss) and/or, without a loss, by an expert bias added to the scores for
the choice only, moved after each optimizer step from the tokens each expert received (``update_expert_bias``).

Under pipeline stages no single step sees every layer's auxiliary loss, so each layer starts its own loss's backward
from its output (`_AuxLossInBackward`, torchtitan's and DeepSeek's way for a pipelined MoE); a stage keeps its layers'
token counts and the sum of their losses over the step's micro-batches, and the step's end reduces them over all
ranks at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dynatrain.models.context_parallel import CP_ATTR
from dynatrain.models.decoder import Attention, Decoder, FeedForward, RMSNorm, local_tensor
from dynatrain.models.moe_configs import MoEConfig

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


class Router(nn.Module):
    """Token-choice top-k: which experts each token goes to, and with what weight."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k, self.score_func, self.route_norm = cfg.top_k, cfg.score_func, cfg.route_norm
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None):
        """x: [T, D] -> (weights [T, k], experts [T, k], scores [T, E] in fp32)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        # The bias steers the choice only; the weights stay the unbiased scores (auxiliary-loss-free balancing).
        choice = scores if expert_bias is None else scores + expert_bias
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.route_norm and self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts, scores


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored stacked; tokens arrive sorted by expert with the count each expert gets."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        e, f, d = cfg.n_experts, cfg.moe_ffn_dim, cfg.dim
        self.w1 = nn.Parameter(torch.empty(e, f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))
        self.w3 = nn.Parameter(torch.empty(e, f, d))
        self.use_grouped_mm = _HAS_GROUPED_MM

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        if x.shape[0] == 0:
            # With expert parallelism a rank may receive no token at all. The grouped kernel's backward rejects an
            # empty input. The output must still depend on the weights (every rank then reduces a zero gradient)
            # and on the input: its backward is the dispatch all-to-all's, which every ep rank must join.
            return x.new_zeros(0, w2.shape[1]) + 0 * (x.sum() + (w1.sum() + w2.sum() + w3.sum()).to(x.dtype))
        if self.use_grouped_mm:
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
            h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        return expert_loop(x, counts, w1, w2, w3)


def expert_loop(x: torch.Tensor, counts: torch.Tensor, w1, w2, w3) -> torch.Tensor:
    """The per-expert loop the grouped kernel replaces (and equals)."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n]
        out.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        start += n
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


class _AuxLossInBackward(torch.autograd.Function):
    """The identity on a layer's output whose backward also gives the layer's auxiliary loss a gradient of one, as if
    the loss were added to the objective: the micro-batch's backward through this stage then carries it, whichever
    stage computes the objective."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype = aux.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=grad.device)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.load_balance_coeff, self.bias_update_rate = cfg.load_balance_coeff, cfg.bias_update_rate
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg)
        self.shared_expert = FeedForward(cfg.dim, cfg.shared_ffn_dim) if cfg.shared_ffn_dim else None
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts), persistent=True)
        # Tokens each expert received since the last bias update: the load metric and the bias update's input.
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts), persistent=True)
        self.aux_loss: torch.Tensor | None = None
        # Set where the layer runs in a pipeline stage: its auxiliary loss then joins the backward through its output.
        self.aux_in_backward = False
        # The step's auxiliary losses so far (detached) and how many forwards made them: what a stage reports.
        self.aux_sum: torch.Tensor | None = None
        self.aux_forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        bias = self.expert_bias if self.bias_update_rate > 0 else None
        weights, experts, scores = self.router(tokens, bias)
        flat = experts.reshape(-1)
        counts = torch.bincount(flat, minlength=self.n_experts)
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        routed = self.experts(tokens[token_of], counts)
        routed = routed * weights.reshape(-1)[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(tokens).index_add(0, token_of, routed.to(tokens.dtype))
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        with torch.no_grad():
            self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        self.aux_loss = None
        if self.training and self.load_balance_coeff > 0:
            # Switch-Transformer balance: E * sum_e (share of the token choices e got) * (e's mean score).
            share = counts.to(scores.dtype) / flat.numel()
            cp = self.__dict__.get(CP_ATTR)
            if cp is not None:
                # The share is over the whole sequence's choices: the cp group's counts summed (a token count has
                # no gradient). The mean score stays this rank's: every cp rank holds as many tokens, so the mean
                # of the ranks' losses is the unsplit loss, and each rank's gradient is cp times its tokens' share
                # of the unsplit gradient, which FSDP's average over dp_shard x cp brings back.
                share = cp.sum(counts).to(scores.dtype) / (flat.numel() * cp.size)
            self.aux_loss = self.load_balance_coeff * self.n_experts * (share * scores.mean(0)).sum()
            aux = self.aux_loss.detach()
            self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux
            self.aux_forwards += 1
            if self.aux_in_backward:
                out = _AuxLossInBackward.apply(out, self.aux_loss)
        return out.view(bsz, seq, dim)

    @torch.no_grad()
    def reset_stats(self) -> None:
        """Start the step's token counts and auxiliary-loss sum again."""
        self.tokens_per_expert.zero_()
        self.aux_sum, self.aux_forwards = None, 0

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor | None = None) -> None:
        """After an optimizer step: move each expert's bias toward the mean load (up when it got fewer tokens
        than the mean), then start counting again. ``tokens_per_expert``: the counts summed over the
        data-parallel ranks (default: this rank's)."""
        counts = self.tokens_per_expert if tokens_per_expert is None else tokens_per_expert
        if self.bias_update_rate > 0:
            self.expert_bias += self.bias_update_rate * torch.sign(counts.mean() - counts)
        self.reset_stats()


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.attn_head_dim, cfg.qk_norm, cfg.norm_eps)
        self.moe = MoE(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.moe(self.ffn_norm(h))


class MoETransformer(Decoder):
    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg, MoEBlock, cfg.attn_head_dim)

    def aux_loss(self) -> torch.Tensor | None:
        """The load-balancing losses of the last forward, summed over layers (None when off)."""
        losses = [layer.moe.aux_loss for layer in self.layers.values() if layer.moe.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the non-persistent buffers (after `to_empty`); the routers' start at zero."""
        super().init_buffers(device)
        for layer in self.layers.values():
            layer.moe.expert_bias.zero_()
            layer.moe.reset_stats()
