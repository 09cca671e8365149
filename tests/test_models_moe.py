"""The mixture-of-experts decoder: published sizes, grouped experts equal to a loop, routing, balancing, init."""

from __future__ import annotations

import pytest
import torch

from dynatrain.models.moe import MoE, MoETransformer, expert_loop
from dynatrain.models.moe_configs import MOE_CONFIGS, MoEConfig, get_moe_config


@pytest.mark.parametrize("name,total,active", [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9), ("mixtral-8x7b", 46.7e9, 12.9e9),
])
def test_published_shapes_have_their_published_sizes(name, total, active):
    cfg = get_moe_config(name)
    assert abs(cfg.num_params() - total) / total < 0.005
    assert abs(cfg.active_params() - active) / active < 0.02


def test_bad_configs_say_what_to_change():
    with pytest.raises(ValueError, match="top_k=9 is larger than n_experts=8: choose top_k <= 8"):
        MOE_CONFIGS["moe-debug"].with_overrides(top_k=9)
    with pytest.raises(ValueError, match="score_func"):
        MOE_CONFIGS["moe-debug"].with_overrides(score_func="relu")
    with pytest.raises(ValueError, match="unknown mixture-of-experts model"):
        get_moe_config("moe-9000")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_a_per_expert_loop_forward_and_backward(dtype):
    torch.manual_seed(0)
    cfg = MOE_CONFIGS["moe-debug"]
    model = MoETransformer(cfg)
    model.init_weights()
    experts = model.layers["0"].moe.experts.to(dtype)
    counts = torch.tensor([5, 0, 3, 0, 7, 1, 0, 4])  # experts with no token included
    x = torch.randn(int(counts.sum()), cfg.dim, dtype=dtype, requires_grad=True)
    grad = torch.randn(int(counts.sum()), cfg.dim, dtype=dtype)  # dense: the kernel's backward needs one
    grouped = experts(x, counts)
    grouped.backward(grad)
    g_x, g_w = x.grad.clone(), [w.grad.clone() for w in (experts.w1, experts.w2, experts.w3)]
    x.grad = None
    for w in (experts.w1, experts.w2, experts.w3):
        w.grad = None
    looped = expert_loop(x, counts, experts.w1, experts.w2, experts.w3)
    looped.backward(grad)
    tol = 0 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped, looped, atol=tol or 1e-6, rtol=tol or 1e-6)
    torch.testing.assert_close(x.grad, g_x, atol=tol or 1e-6, rtol=tol or 1e-6)
    for w, g in zip((experts.w1, experts.w2, experts.w3), g_w):
        torch.testing.assert_close(w.grad, g, atol=tol or 1e-6, rtol=tol or 1e-6)
    assert experts.w1.grad[1].abs().sum() == 0  # an expert without tokens gets no gradient


def test_the_model_trains_and_its_parameters_are_the_configs_shapes():
    cfg = MOE_CONFIGS["moe-debug"]
    model = MoETransformer(cfg)
    model.init_weights()
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == cfg.param_shapes()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + model.aux_loss()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.layers["0"].moe.tokens_per_expert.sum() == 2 * 16 * cfg.top_k


def test_router_weights_and_the_bias_that_steers_only_the_choice():
    cfg = MOE_CONFIGS["moe-debug"].with_overrides(score_func="sigmoid")
    moe = MoE(cfg)
    x = torch.randn(10, cfg.dim)
    weights, experts, scores = moe.router(x, None)
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))  # renormalised top-k
    bias = torch.zeros(cfg.n_experts)
    bias[3] = 10.0  # a large bias makes every token pick expert 3, with its unbiased score as the weight
    weights_b, experts_b, _ = moe.router(x, bias)
    assert (experts_b == 3).any(-1).all()
    unnormed = MoE(cfg.with_overrides(route_norm=False))
    w, e, s = unnormed.router(x, None)
    torch.testing.assert_close(w, s.gather(-1, e))


def test_expert_bias_moves_toward_the_mean_load_and_the_counter_restarts():
    moe = MoE(MOE_CONFIGS["moe-debug"])
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]))
    moe.update_expert_bias()
    assert moe.expert_bias[0] < 0 and moe.expert_bias[1] > 0 and moe.expert_bias[7] < 0
    assert moe.tokens_per_expert.sum() == 0


def test_initial_weights_depend_on_name_and_seed_only():
    cfg = MoEConfig("tiny-moe", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32, n_experts=4, top_k=2,
                    moe_ffn_dim=8, qk_norm=True)
    a, b = MoETransformer(cfg), MoETransformer(cfg)
    a.init_weights()
    b.init_weights()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    w1 = a.layers["0"].moe.experts.w1
    assert not torch.equal(w1[0], w1[1])  # each expert its own values


def test_tokens_received_by_source_are_regrouped_by_expert_and_back():
    """What ExpertParallel does between its two all-to-alls: blocks arrive as (source rank, local expert) and the
    grouped matmul wants (local expert, source rank); the combine puts every row back where it came from."""
    from dynatrain.models.expert_parallel import _expert_major

    received = torch.tensor([[2, 0, 1], [0, 3, 0], [1, 1, 2]])  # [source, expert], empty blocks included
    rows = torch.arange(int(received.sum()))
    labels = [(s, e) for s in range(3) for e in range(3) for _ in range(int(received[s, e]))]
    order = _expert_major(received)
    assert [labels[i] for i in order] == sorted(labels, key=lambda se: (se[1], se[0]))
    back = torch.empty_like(rows).index_copy(0, order, rows[order])
    assert torch.equal(back, rows)
    assert _expert_major(torch.zeros(2, 4, dtype=torch.long)).numel() == 0


def test_grouped_experts_take_a_rank_that_received_no_token():
    cfg = MOE_CONFIGS["moe-debug"]
    model = MoETransformer(cfg)
    model.init_weights()
    experts = model.layers["0"].moe.experts
    x = torch.zeros(0, cfg.dim, requires_grad=True)
    out = experts(x, torch.zeros(cfg.n_experts, dtype=torch.long))
    assert out.shape == (0, cfg.dim)
    out.sum().backward()
    assert all(w.grad is not None and w.grad.abs().sum() == 0 for w in (experts.w1, experts.w2, experts.w3))
    assert x.grad is not None  # the backward reaches the input: the dispatch all-to-all's backward runs
