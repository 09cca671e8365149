"""Mixture-of-experts models under pipeline stages, on one process: the analytic layouts (`moe_specs.moe_layout` with
pp) hold exactly the boxes the parallelisation gives each stage, the stage split balances what a token computes
(uneven splits included), and a layer's auxiliary loss started from its output's backward gives the gradients of
the loss added to the objective."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dynatrain.lm import moe_load  # noqa: E402
from dynatrain.models.moe_configs import MOE_CONFIGS  # noqa: E402
from dynatrain.models.moe_specs import moe_block_flops, moe_stage_split  # noqa: E402
from dynatrain.models.specs import layout_for_model  # noqa: E402
from dynatrain.models.stage_split import balanced_split, model_stage_costs  # noqa: E402
from dynatrain.vps import Layout, ParallelConfig  # noqa: E402
from tests._stage_capture import assert_stage_boxes_equal, captured_stage_layout  # noqa: E402

DEBUG = MOE_CONFIGS["moe-debug"]
FIVE = DEBUG.with_overrides(name="moe-debug-5", n_layers=5)
LAYOUTS = [
    (DEBUG, "pp=2,dp_shard=2,ep=2", 1),
    (DEBUG, "pp=2,tp=2", 1),
    (DEBUG, "pp=2,dp_replicate=2,dp_shard=2,ep=2", 1),
    (FIVE, "pp=3,dp_shard=4,ep=4", 1),  # 5 layers on 3 stages: 2, 2, 1 (the last pays for the output)
    (FIVE, "pp=2,dp_shard=2,tp=2,ep=2", 2),  # interleaved: stages 0 and 2 on pp rank 0
]


def _captured_layout(cfg, pcfg: ParallelConfig, stages_per_rank: int) -> Layout:
    from dynatrain.models.moe import MoETransformer
    from dynatrain.models.parallelize import ParallelizeOptions
    from dynatrain.models.parallelize_moe import parallelize_moe

    def parallelize(model, mesh) -> None:
        parallelize_moe(model, mesh, pcfg, ParallelizeOptions(stages_per_rank=stages_per_rank))
        assert all(layer.moe.aux_in_backward for layer in model.layers.values())

    return captured_stage_layout(pcfg, lambda: MoETransformer(cfg), parallelize)


@pytest.mark.parametrize("cfg,layout,per_rank", LAYOUTS, ids=[f"{c.name}:{t}:v{v}" for c, t, v in LAYOUTS])
def test_analytic_moe_pipeline_boxes_equal_the_captured_ones(one_process_group, cfg, layout, per_rank):
    pcfg = ParallelConfig.parse(layout)
    captured = _captured_layout(cfg, pcfg, per_rank)
    assert_stage_boxes_equal(layout_for_model(cfg, pcfg, stages_per_rank=per_rank), captured, pcfg)


def test_the_moe_stage_split_balances_what_a_token_computes():
    # A block costs its attention, router, top-k routed experts and shared expert per token, not its stored experts.
    cfg = MOE_CONFIGS["qwen3-235b-a22b"]
    hd = cfg.attn_head_dim
    per_token = (2 * cfg.dim * (cfg.n_heads + cfg.n_kv_heads) * hd + cfg.dim * cfg.n_experts
                 + 3 * cfg.dim * cfg.top_k * cfg.moe_ffn_dim)
    assert moe_block_flops(cfg) == per_token
    first, last = model_stage_costs(cfg, moe_block_flops(cfg))
    assert first == 0 and 2.5 < last < 3.0  # the output projection: dim * vocab beside a block
    split = moe_stage_split(cfg, 8)
    assert split == balanced_split(94, 8, 0.0, last)
    assert split[0][0] == 0 and split[-1][1] == 94 and all(a[1] == b[0] for a, b in zip(split, split[1:]))
    # 94 layers and the output on 8 stages: the last stage, which pays for the output, gets fewer layers.
    sizes = [hi - lo for lo, hi in split]
    assert sizes[-1] < min(sizes[:-1]) and max(hi - lo + (last if k == 7 else 0) for k, (lo, hi) in
                                               enumerate(split)) < 13
    # Uneven: five layers on three stages.
    assert moe_stage_split(FIVE, 3) == ((0, 2), (2, 4), (4, 5))
    with pytest.raises(ValueError, match="at least one layer"):
        moe_stage_split(DEBUG, 3)


def _routed_grads(aux_in_backward: bool):
    from dynatrain.models.moe import MoETransformer

    torch.manual_seed(0)
    cfg = DEBUG.with_overrides(load_balance_coeff=0.5)  # large enough to move the routers' gradients visibly
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    for layer in model.layers.values():
        layer.moe.aux_in_backward = aux_in_backward
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    (loss if aux_in_backward else loss + model.aux_loss()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, model


def test_the_auxiliary_loss_in_backward_gives_the_gradients_of_the_loss_added():
    started, model = _routed_grads(True)
    added, _ = _routed_grads(False)
    assert started.keys() == added.keys()
    for name in started:
        torch.testing.assert_close(started[name], added[name], rtol=1e-5, atol=1e-7, msg=name)
    # Without it the routers would miss the auxiliary loss's gradient: the check above can fail.
    gate = "layers.0.moe.router.gate.weight"
    model.zero_grad()
    for layer in model.layers.values():
        layer.moe.aux_in_backward = False
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 16))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert not torch.allclose(model.get_parameter(gate).grad, started[gate])


def test_a_stage_reports_its_own_layers_counts_and_auxiliary_loss(one_process_group):
    from dynatrain.models.moe import MoETransformer
    from dynatrain.models.pipeline_split import split_model

    with torch.device("meta"):
        model = MoETransformer(FIVE)
    split_model(model, moe_stage_split(FIVE, 3), 3, 1)  # the middle stage: layers 2 and 3
    model.to_empty(device="cpu")
    model.init_weights()
    model.train()
    h = torch.randn(2, 8, FIVE.dim)
    for layer in model.layers.values():
        h = layer(h, model.freqs_cis)
    counts = moe_load.local_counts(model)
    assert counts.shape == (5, FIVE.n_experts)
    per_token = 2 * 8 * FIVE.top_k
    assert counts.sum(-1).tolist() == [0, 0, per_token, per_token, 0]
    aux = moe_load.stage_aux(model)
    expected = sum(model.layers[k].moe.aux_loss.detach() for k in ("2", "3"))
    torch.testing.assert_close(aux, expected)
    moe_load.apply_load(model, counts * 3)
    assert moe_load.local_counts(model).sum() == 0 and moe_load.stage_aux(model) is None
    assert model.layers["2"].moe.expert_bias.abs().sum() > 0  # the job's counts moved the held layers' bias


@pytest.mark.parametrize("discard", [True, False])
def test_the_routers_count_the_steps_micro_batches_only_not_the_shape_inference(one_process_group, discard):
    # torch runs one extra forward on the first micro-batch to learn the shapes between stages; the module's
    # `on_pipeline_shapes_inferred` forgets what the routers counted there (without it they count it too).
    from torch.distributed.device_mesh import DeviceMesh

    from dynatrain.models.moe import MoETransformer
    from dynatrain.models.pipeline_split import split_model
    from dynatrain.strategies.pipeline_runner import PipelineRunner

    with torch.device("meta"):
        model = MoETransformer(DEBUG)
    stages = split_model(model, ((0, DEBUG.n_layers),), 1, 0)
    model.to_empty(device="cpu")
    model.init_weights()
    mesh = DeviceMesh("cpu", torch.arange(1), mesh_dim_names=("pp",))
    loss = lambda out, target: torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())  # noqa: E731
    runner = PipelineRunner(stages, mesh, "GPipe", loss, torch.device("cpu"),
                            after_inference=(lambda: moe_load.reset_counts(model)) if discard else None)
    tokens = torch.randint(0, DEBUG.vocab_size, (4, 16))
    runner.train_step(tokens, tokens, 2)
    per_step = 4 * 16 * DEBUG.top_k  # every token's top-k choices, once per layer
    first_micro_batch = 2 * 16 * DEBUG.top_k
    expected = per_step if discard else per_step + first_micro_batch
    assert moe_load.local_counts(model).sum(-1).tolist() == [expected] * DEBUG.n_layers
    assert all(layer.moe.aux_forwards == (2 if discard else 3) for layer in model.layers.values())
