"""Splitting a model into pipeline stages: the balanced layer split, stage views, and states held by one stage."""

import copy
import itertools

import pytest
import torch
from torch import nn

from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.models.llama import Transformer
from dynatrain.models.pipeline_split import pipeline_stages, split_model
from dynatrain.models.stage_split import balanced_split, rank_stages, stage_of_layer, stage_split
from dynatrain.strategies.pipeline_runner import check_pipeline_module, check_schedule, pipeline_batch
from dynatrain.vps.placement import Shard, Sharding, sharding_shards


def _cost(split, first, last):
    return max((hi - lo) + (first if k == 0 else 0) + (last if k == len(split) - 1 else 0)
               for k, (lo, hi) in enumerate(split))


@pytest.mark.parametrize("n_layers,n_stages,first,last", [(4, 3, 0, 0), (7, 3, 0, 2.5), (12, 4, 0, 3.47), (5, 5, 1, 1)])
def test_the_split_is_contiguous_and_no_other_split_has_a_lighter_busiest_stage(n_layers, n_stages, first, last):
    split = balanced_split(n_layers, n_stages, first, last)
    assert split[0][0] == 0 and split[-1][1] == n_layers
    assert all(a[1] == b[0] for a, b in zip(split, split[1:])) and all(hi > lo for lo, hi in split)
    best = min(_cost(tuple(zip((0, *cuts), (*cuts, n_layers))), first, last)
               for cuts in itertools.combinations(range(1, n_layers), n_stages - 1))
    assert _cost(split, first, last) == pytest.approx(best)


def test_uneven_layers_and_a_heavy_head():
    assert balanced_split(4, 3) == ((0, 1), (1, 2), (2, 4))
    # 125m's output projection costs about 3.5 blocks: the last stage holds fewer layers.
    split = stage_split(MODEL_CONFIGS["125m"], 4)
    assert split[-1][1] - split[-1][0] < split[0][1] - split[0][0]
    assert [stage_of_layer(split, i) for i in (0, 11)] == [0, 3]
    assert rank_stages(2, 2, 1) == (1, 3)
    with pytest.raises(ValueError, match="8 pipeline stages need at least one layer each, and the model has 4"):
        balanced_split(4, 8)


def _model(n_layers=4):
    cfg = MODEL_CONFIGS["debug"].with_overrides(n_layers=n_layers, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                                vocab_size=97)
    model = Transformer(cfg)
    model.init_weights()
    return model


def test_stages_keep_their_names_and_chained_views_compute_the_whole_model():
    full = _model()
    tokens = torch.randint(0, 97, (2, 16))
    expected = full(tokens)
    split = ((0, 1), (1, 2), (2, 4))
    parts = []
    for coordinate in range(3):
        part = copy.deepcopy(full)
        stages = split_model(part, split, pp=3, coordinate=coordinate)
        assert stages.stage_ids == (coordinate,) and pipeline_stages(part) is stages
        parts.append((part, stages))
    names = [set(n for n, _ in part.named_parameters()) for part, _ in parts]
    assert {n.split(".")[0] for n in names[0]} == {"tok_embeddings", "layers"}
    assert {n.split(".")[0] for n in names[2]} == {"layers", "norm", "output"}
    assert names[0] | names[1] | names[2] == {n for n, _ in full.named_parameters()}
    assert not (names[0] & names[1]) and not (names[1] & names[2])
    assert sorted(parts[2][0].layers.keys()) == ["2", "3"]
    h = tokens
    for part, stages in parts:
        (view,) = stages.views
        assert not list(view.named_parameters()) or all(p is dict(part.named_parameters())[n]
                                                         for n, p in view.named_parameters())
        h = view(h)
    torch.testing.assert_close(h, expected, rtol=0, atol=0)


def test_interleaved_views_and_a_buffer_the_model_recomputes():
    model = _model()
    stages = split_model(model, ((0, 1), (1, 2), (2, 3), (3, 4)), pp=2, coordinate=0, stages_per_rank=2)
    assert stages.stage_ids == (0, 2) and sorted(model.layers.keys()) == ["0", "2"]
    first, third = stages.views
    assert first.tok_embeddings is model.tok_embeddings and first.output is None and third.tok_embeddings is None
    model.init_buffers("cpu")  # what materialising does after to_empty
    assert first.freqs_cis is model.freqs_cis


def test_what_cannot_be_split_is_refused_with_the_contract():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2)])

    with pytest.raises(ValueError, match="needs its blocks in an nn.ModuleDict called `layers`"):
        split_model(Flat(), ((0, 1),), pp=1, coordinate=0)
    with pytest.raises(ValueError, match="has no `pipeline_loss\\(output, target\\)` method"):
        check_pipeline_module(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Interleaved1F1B runs several stages per rank"):
        check_schedule("Interleaved1F1B", 1)
    with pytest.raises(ValueError, match="use one of GPipe, 1F1B, Interleaved1F1B"):
        check_schedule("ZeroBubble", 1)
    with pytest.raises(ValueError, match="a pair \\(inputs, target\\)"):
        pipeline_batch({"tokens": torch.zeros(1)})


def test_a_stage_state_is_held_by_its_stage_positions_only():
    stage1 = Sharding((2, 1, 2, 1), (Shard(0),), ((2,),)).held_along(0, (1,))
    shards = sharding_shards((6, 3), stage1)
    assert [s.numel for s in shards] == [0, 0, 9, 9] and shards[0].local_shape == (0, 0)
    both = stage1.union(Sharding((2, 1, 2, 1), (Shard(0),), ((2,),)).held_along(0, (0,)))
    assert both.held is None and both == Sharding((2, 1, 2, 1), (Shard(0),), ((2,),))
    with pytest.raises(ValueError, match="placed .* on one pipeline stage and .* on another"):
        stage1.union(Sharding((2, 1, 2, 1)))
    with pytest.raises(ValueError, match="held along mesh dimension 2"):
        Sharding((2, 1, 2, 1), (Shard(0),), ((2,),), held=(2, (0,)))


def test_the_rule_based_layout_refuses_pipeline_stages_it_cannot_place():
    from dynatrain.vps import Layout, ParallelConfig
    from dynatrain.vps.layout import StateSpec

    with pytest.raises(ValueError, match="has pipeline stages, and the rules do not say which stage holds"):
        Layout.from_config([StateSpec("w", (4, 4))], ParallelConfig.parse("pp=2"))
