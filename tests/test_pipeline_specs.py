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
from tests._stage_capture import assert_stage_boxes_equal, captured_stage_layout  # noqa: E402

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
    from dynatrain.models.parallelize import ParallelizeOptions
    from dynatrain.models.parallelize_dense import parallelize_dense

    options = ParallelizeOptions(stages_per_rank=stages_per_rank)
    return captured_stage_layout(pcfg, lambda: Transformer(cfg),
                                 lambda model, mesh: parallelize_dense(model, mesh, pcfg, options))


@pytest.mark.parametrize("cfg,layout,per_rank", LAYOUTS, ids=[f"{c.name}:{t}:v{v}" for c, t, v in LAYOUTS])
def test_analytic_pipeline_boxes_equal_the_captured_ones(one_process_group, cfg, layout, per_rank):
    pcfg = ParallelConfig.parse(layout)
    captured = _captured_layout(cfg, pcfg, per_rank)
    assert_stage_boxes_equal(layout_for_model(cfg, pcfg, stages_per_rank=per_rank), captured, pcfg)
