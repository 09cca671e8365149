from __future__ import annotations

import pytest

from dynatrain.models.specs import layout_for_model
from dynatrain.models.configs import get_model_config
from dynatrain.models.specs import model_states
from dynatrain.vps import Layout, ParallelConfig, StateSpec
from dynatrain.vps.box import Box


def test_model_states_names_and_dtypes():
    cfg = get_model_config("debug")
    states = model_states(cfg)
    assert len(states) == 3 * len(cfg.param_shapes())
    assert [s.name for s in states[:3]] == [
        "tok_embeddings.weight", "tok_embeddings.weight.exp_avg", "tok_embeddings.weight.exp_avg_sq"
    ]
    assert sum(s.nbytes for s in states) == 12 * cfg.num_params()
    mixed = model_states(cfg, "bf16-adam")
    assert [(s.name.rsplit(".", 1)[-1], s.dtype) for s in mixed[4:8]] == [
        ("weight", "bfloat16"), ("master", "float32"), ("exp_avg", "float32"), ("exp_avg_sq", "float32")
    ]
    assert sum(s.nbytes for s in mixed) == 14 * cfg.num_params()
    with pytest.raises(ValueError, match="unknown state kind"):
        model_states(cfg, "fp8")


def test_classes_are_shared_by_layers_and_moments():
    layout = layout_for_model("llama3-70b", ParallelConfig(dp_shard=4, tp=2))
    # wq, wk=wv, wo, w1=w3, w2, norms, embedding=output: 7 distinct splits for 2,169 states.
    assert len(layout.classes) == 7 and len(layout.states) == 3 * (80 * 9 + 3)


def test_layout_queries_and_rank_map():
    states = (StateSpec("w", (8, 4), tp_dim=0), StateSpec("n", (4,)))
    cfg = ParallelConfig(dp_replicate=2, dp_shard=2, tp=2)
    layout = Layout.from_config(states, cfg, rank_map=[10, 11, 12, 13, 14, 15, 16, 17])
    assert layout.processes == tuple(range(10, 18)) and layout.position_of(13) == 3
    assert layout.boxes("w", 13) == (Box((6, 0), (8, 4)),)  # s=1, t=1 -> tp rows [4,8), fsdp half 2
    assert layout.boxes("n", 13) == (Box((2,), (4,)),)
    assert layout.boxes("w", 3) == () and layout.shards("w", 3) is None
    assert layout.total_bytes == (32 + 4) * 4
    # w held twice (dp_replicate), n four times (dp_replicate x tp)
    assert layout.needed_bytes == (2 * 32 + 4 * 4) * 4
    assert sum(layout.held_bytes(p) for p in layout.processes) == layout.needed_bytes
    moved = layout.with_rank_map([17, 16, 15, 14, 13, 12, 11, 10])
    assert moved.boxes("w", 17) == layout.boxes("w", 10)
    lost = layout.without([12])
    assert 12 not in lost.processes and lost.world_size == 8
    with pytest.raises(ValueError, match="two positions"):
        layout.with_rank_map([10, 10, 12, 13, 14, 15, 16, 17])
    with pytest.raises(ValueError, match="hold no position"):
        layout.without([3])
    with pytest.raises(ValueError, match="no state named"):
        layout.boxes("missing", 10)


def test_layouts_of_different_states_are_refused():
    a = Layout.from_config((StateSpec("w", (4,)),), ParallelConfig())
    b = Layout.from_config((StateSpec("w", (5,)),), ParallelConfig())
    with pytest.raises(ValueError, match="different states"):
        a.same_states(b)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="unknown dtype"):
        StateSpec("w", (4,), "float8")
    with pytest.raises(ValueError, match="scalar"):
        StateSpec("step", ())
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        layout_for_model("debug", ParallelConfig(tp=3))
