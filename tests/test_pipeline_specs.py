"""The analytic specs of pipeline layouts (`models.specs.layout_for_model` with pp) hold exactly the boxes the
running job holds: the zoo's model is built on meta and parallelised by the strategy's own function once per stage
(this process placed on that stage of a probe mesh), its placements captured as a switch reads them, merged over the
stages, and every state's boxes compared with the analytic ones at every position."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dynatrain.models.configs import MODEL_CONFIGS  # noqa: E402
from dynatrain.models.specs import layout_for_model  # noqa: E402
from dynatrain.vps import Layout, ParallelConfig  # noqa: E402

DEBUG = MODEL_CONFIGS["debug"]
SIX = DEBUG.with_overrides(name="debug-6", n_layers=6)
LAYOUTS = [
    (DEBUG, "pp=2", 1),
    (DEBUG, "pp=3", 1),  # 4 layers on 3 stages
    (DEBUG, "pp=4,tp=2", 1),
    (DEBUG, "pp=2,dp_shard=2,tp=2", 1),
    (DEBUG, "pp=2,dp_replicate=2,dp_shard=2", 1),
    (DEBUG, "pp=2", 2),  # interleaved: stages 0 and 2 on pp rank 0
    (SIX, "pp=3,dp_shard=2", 2),
]


def _captured_layout(cfg, pcfg: ParallelConfig, stages_per_rank: int) -> Layout:
    from dynatrain.models.llama import Transformer
    from dynatrain.models.parallelize import parallelize_llama
    from dynatrain.switch.capture import BUFFER, capture

    from dynatrain.switch.probe import probe_mesh

    specs, shardings = {}, {}
    for stage in range(pcfg.pp):
        with probe_mesh(pcfg, stage=stage) as mesh:
            with torch.device("meta"):
                model = Transformer(cfg)
            parallelize_llama(model, mesh, pcfg, stages_per_rank=stages_per_rank)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for p in model.parameters():  # Adam's state as a step creates it, without running one
                opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}
            cap = capture(model, opt, mesh)
        for spec, sh in zip(cap.specs, cap.shardings):
            if cap.param_of[spec.name][1] == BUFFER:
                continue  # the zoo plans no buffer
            assert spec.name not in specs, f"{spec.name} on two stages"
            specs[spec.name], shardings[spec.name] = spec, sh
    names = sorted(specs)
    return Layout.from_shardings([specs[n] for n in names], [shardings[n] for n in names], pcfg)


@pytest.mark.parametrize("cfg,layout,per_rank", LAYOUTS, ids=[f"{c.name}:{t}:v{v}" for c, t, v in LAYOUTS])
def test_analytic_pipeline_boxes_equal_the_captured_ones(one_process_group, cfg, layout, per_rank):
    pcfg = ParallelConfig.parse(layout)
    captured = _captured_layout(cfg, pcfg, per_rank)
    analytic = layout_for_model(cfg, pcfg, stages_per_rank=per_rank)
    assert sorted((s.name, s.shape, s.dtype) for s in analytic.states) == \
        [(s.name, s.shape, s.dtype) for s in captured.states]
    for spec in analytic.states:
        held = 0
        for p in range(pcfg.world_size):
            assert analytic.shards(spec.name, p) == captured.shards(spec.name, p), (layout, spec.name, p)
            held += bool(analytic.shards(spec.name, p).boxes)
        assert 0 < held <= pcfg.stage_size  # one stage's positions at most
