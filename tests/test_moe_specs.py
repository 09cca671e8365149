"""The analytic MoE specs (`models.moe_specs`) hold exactly the boxes `parallelize_moe` gives: the model is built on
the meta device and parallelised on a mesh of fake process groups (`probe_mesh`) for each layout, its placements
(parameters and Adam moments) captured as the running strategy reads them, and every state's boxes compared with
the analytic ones at every position."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dynatrain.models.moe_configs import MOE_CONFIGS  # noqa: E402
from dynatrain.models.specs import layout_for_model  # noqa: E402
from dynatrain.vps import Layout, ParallelConfig  # noqa: E402

DEBUG = MOE_CONFIGS["moe-debug"]
# 12 experts: with ep=2 over dp_shard=8 each ep rank's 6 experts split over 4 efsdp ranks as 2, 2, 2, 0.
UNEVEN = DEBUG.with_overrides(name="moe-debug-12", n_experts=12)
LAYOUTS = [
    (DEBUG, "dp_shard=4"),
    (DEBUG, "dp_shard=4,ep=2"),
    (DEBUG, "dp_shard=4,ep=4"),
    (DEBUG, "dp_shard=2,tp=2,ep=2"),
    (DEBUG, "dp_shard=2,tp=2"),
    (DEBUG, "dp_replicate=2,dp_shard=2,ep=2"),
    (DEBUG, "dp_shard=8,ep=4"),
    (DEBUG, "dp_shard=8,ep=8"),
    (DEBUG, "dp_shard=4,tp=2,ep=2"),
    (DEBUG, "dp_shard=2,tp=4,ep=2"),
    (DEBUG, "dp_replicate=2,dp_shard=4,ep=2"),
    (DEBUG, "dp_replicate=2,dp_shard=2,tp=2,ep=2"),
    (UNEVEN, "dp_shard=8,ep=2"),
    (UNEVEN, "dp_shard=4,tp=2,ep=4"),
    # context parallelism: FSDP over dp_shard x cp, and ep taking whole cp groups from dp_shard x cp
    (DEBUG, "dp_shard=2,cp=2,tp=2"),
    (DEBUG, "dp_shard=2,cp=2,ep=2"),
    (DEBUG, "dp_shard=2,cp=2,ep=4"),
    (DEBUG, "dp_replicate=2,dp_shard=4,cp=2,tp=2,ep=4"),
    (UNEVEN, "dp_shard=4,cp=2,ep=2"),
]


def _captured_layout(cfg, pcfg: ParallelConfig) -> Layout:
    from dynatrain.models.moe import MoETransformer
    from dynatrain.models.parallelize_moe import parallelize_moe
    from dynatrain.switch.capture import BUFFER, capture
    from dynatrain.switch.probe import probe_mesh

    with probe_mesh(pcfg) as mesh:
        with torch.device("meta"):
            model = MoETransformer(cfg)
        parallelize_moe(model, mesh, pcfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():  # Adam's state as a step creates it, without running one
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}
        cap = capture(model, opt, mesh)
    routed = [i for i, s in enumerate(cap.specs) if cap.param_of[s.name][1] != BUFFER]  # the zoo plans no buffer
    return Layout.from_shardings([cap.specs[i] for i in routed], [cap.shardings[i] for i in routed], pcfg)


@pytest.mark.parametrize("cfg,layout", LAYOUTS, ids=[f"{c.name}:{t}" for c, t in LAYOUTS])
def test_analytic_moe_boxes_equal_the_captured_ones(one_process_group, cfg, layout):
    pcfg = ParallelConfig.parse(layout)
    captured = _captured_layout(cfg, pcfg)
    analytic = layout_for_model(cfg, pcfg)
    assert [(s.name, s.shape, s.dtype) for s in analytic.states] == \
        [(s.name, s.shape, s.dtype) for s in captured.states]
    assert any(".moe.experts.w1" in s.name for s in analytic.states)
    for spec in analytic.states:
        for p in range(pcfg.world_size):
            assert analytic.shards(spec.name, p) == captured.shards(spec.name, p), (layout, spec.name, p)


def test_routed_experts_split_over_every_dp_shard_rank_and_stay_whole_over_tp():
    cfg = MOE_CONFIGS["qwen3-235b-a22b"]
    pcfg = ParallelConfig.parse("dp_shard=32,tp=4,ep=16")
    layout = layout_for_model(cfg, pcfg)
    name = "layers.0.moe.experts.w1"
    e, f, d = cfg.n_experts, cfg.moe_ffn_dim, cfg.dim
    held = [layout.shards(name, p).numel for p in range(pcfg.world_size)]
    assert held == [e * f * d // pcfg.dp_shard] * pcfg.world_size
    # Every TP rank of a group holds the same experts.
    assert layout.boxes(name, 0) == layout.boxes(name, 3)
    # Position 4 (dp_shard index 1) is the next ep rank: the next block of 128 / 16 = 8 experts, split over
    # efsdp = 2; position 64 (dp_shard index 16) holds the other half of ep rank 0's block.
    [box] = layout.boxes(name, 4)
    assert (box.lo[0], box.hi[0]) == (8, 12)
    [box] = layout.boxes(name, 64)
    assert (box.lo[0], box.hi[0]) == (4, 8)


@pytest.mark.parametrize("model,layout,expected", [
    ("qwen3-235b-a22b", "dp_shard=24,ep=24", "ep=24 does not divide n_experts=128"),
    ("llama3-8b", "dp_shard=4,ep=2", "has none: use ep=1"),
])
def test_bad_expert_layouts_are_refused_with_the_validate_message(model, layout, expected):
    with pytest.raises(ValueError, match=expected):
        layout_for_model(model, ParallelConfig.parse(layout))
