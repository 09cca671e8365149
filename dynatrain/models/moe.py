"""A mixture-of-experts decoder (Qwen3-MoE / Mixtral family). No parallelism inside.

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
from dynatrain.models.llama import (
    Attention,
    FeedForward,
    RMSNorm,
    _local_tensor,
    cp_split,
    init_parameters,
    precompute_freqs_cis,
)
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
        w1, w2, w3 = (_local_tensor(w) for w in (self.w1, self.w2, self.w3))
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


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): MoEBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("freqs_cis", self._freqs_cis(), persistent=False)

    def _freqs_cis(self, device=None) -> torch.Tensor:
        c = self.config
        return precompute_freqs_cis(c.attn_head_dim, c.max_seq_len, c.rope_theta, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds some of the parts (`models.pipeline_split`): a later stage takes hidden states in, an
        # earlier one hands them on. With context parallelism, as the dense model (`models.llama.Transformer`).
        tokens, freqs_cis = cp_split(self, tokens, self.freqs_cis)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def aux_loss(self) -> torch.Tensor | None:
        """The load-balancing losses of the last forward, summed over layers (None when off)."""
        losses = [layer.moe.aux_loss for layer in self.layers.values() if layer.moe.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Every parameter (plain or DTensor) from its layout-independent initial value, seeded per parameter
        and row block as the dense zoo's; an expert is one row of its stacked tensor."""
        cfg = self.config
        init_parameters(self, cfg.dim, cfg.n_layers, cfg.init_seed)
        self.init_buffers(buffer_device or self.freqs_cis.device)

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the non-persistent buffers (after `to_empty`); the routers' start at zero."""
        self.freqs_cis = self._freqs_cis(device=device)
        for layer in self.layers.values():
            layer.moe.expert_bias.zero_()
            layer.moe.reset_stats()


def parallelize_moe(model: MoETransformer, mesh, pcfg, *, mp_policy=None, stages_per_rank: int = 1
                    ) -> MoETransformer:
    """Pipeline, data, tensor and expert parallelism for the MoE decoder, in torchtitan's order:

    - pp: the model keeps the layers of this rank's stages (`models.pipeline_split.split_model`, layers placed by
      `moe_specs.moe_stage_split`), everything below runs on the stage's sub-mesh, and each layer's auxiliary loss
      joins the backward through its output;

    - cp: each sequence split over the cp ranks as in the dense model (`models.context_parallel`); routing is per
      token, so the MoE works on the rank's tokens, and only the auxiliary loss's token shares are summed over the
      cp group (the unsplit model's loss);
    - tp: attention heads, embeddings and the output projection split as in the dense model; the router, the
      shared expert and the routed experts stay whole on every TP rank (each TP rank routes the same tokens);
    - ep: each layer's routed experts split over ``ep`` (`ExpertParallel`), tokens moved by all-to-all; with cp,
      the ep group spans whole cp groups (``ParallelConfig``), each rank sending its own tokens;
    - FSDP2: the experts over the data-parallel ranks outside their ep group (``efsdp``, HSDP with
      ``dp_replicate``), then each block and the root over all data-parallel ranks.

    An expert's gradient holds the tokens of its whole ep group, so its reduction divides by every data-parallel
    rank, as a dense weight's does. ``mesh`` is dynatrain's (``pcfg.mesh_dim_names``) or, without ep, Lightning
    ModelParallelStrategy's (``data_parallel``, ``tensor_parallel``)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from dynatrain.models import tp_styles
    from dynatrain.models.context_parallel import enable_context_parallel
    from dynatrain.models.expert_parallel import ExpertParallel
    from dynatrain.models.moe_specs import moe_stage_split
    from dynatrain.models.parallelize import apply_cp, apply_fsdp, apply_fsdp_stages, apply_tp, dense_meshes
    from dynatrain.models.pipeline_split import split_model

    pcfg.validate(model.config)  # tp against heads, KV heads and vocabulary; ep against the experts
    # Before a pipeline split: the stages' views copy the model's. The routers count the whole sequence's tokens.
    apply_cp(model, mesh, pcfg)
    if pcfg.cp > 1:
        for block in model.layers.values():
            enable_context_parallel(block.moe, mesh["cp"])
    stages = None
    if pcfg.pp > 1:
        split = moe_stage_split(model.config, pcfg.pp, stages_per_rank)
        # From the mesh's coordinates, not the pp group: a probe mesh's groups are not registered with c10d.
        coordinate = mesh.get_coordinate()[mesh.mesh_dim_names.index("pp")]
        stages = split_model(model, split, pcfg.pp, coordinate, stages_per_rank)
        for block in model.layers.values():
            block.moe.aux_in_backward = True
    tp, dp = dense_meshes(mesh, pcfg)
    apply_tp(model, tp, block_plan=tp_styles.MOE_BLOCK_PLAN)
    if pcfg.ep > 1:
        expert_dp = mesh["dp_replicate", "efsdp"] if pcfg.dp_replicate > 1 else mesh["efsdp"]
        kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
        if stages is not None:
            # As the stage's blocks (`apply_fsdp_stages`): every micro-batch's forward runs before its backward.
            kwargs["reshard_after_forward"] = False
        gloo = mesh.device_type == "cpu"  # CPU meshes run on gloo
        # With cp, ep is a flattening (of dp_shard_in_ep and cp), read where the mesh keeps it: slicing it from the
        # root is deprecated in torch.
        ep_mesh = getattr(mesh, "_flatten_mapping", {}).get("ep")
        ep_mesh = mesh["ep"] if ep_mesh is None else ep_mesh
        for block in model.layers.values():
            parallelize_module(block.moe.experts, ep_mesh, ExpertParallel())
            fully_shard(block.moe.experts, mesh=expert_dp, **kwargs)
            # Every rank of a sample's cp group holds a loss of its own tokens, as a data-parallel rank does.
            block.moe.experts.set_gradient_divide_factor(float(pcfg.dp_size * pcfg.cp))
            if gloo and pcfg.efsdp > 1:
                # gloo has no pre-scaled sum: sum, then divide. (Not with one efsdp rank: torch then divides while
                # it copies the gradient and would divide a second time after a forced sum.)
                block.moe.experts.set_force_sum_reduction_for_comms(True)
    if stages is not None:
        apply_fsdp_stages(stages, dp, mp_policy)
        return model
    return apply_fsdp(model, dp, mp_policy=mp_policy)
