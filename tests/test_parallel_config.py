import pytest

from dynatrain.models.configs import get_model_config
from dynatrain.vps import ParallelConfig


def test_parse_and_defaults():
    assert ParallelConfig.parse("dp_shard=2,tp=2") == ParallelConfig(1, 2, 2)
    assert ParallelConfig.parse(" tp = 4 ") == ParallelConfig(tp=4)
    assert ParallelConfig.parse("dp_replicate=2,dp_shard=3,tp=1").world_size == 6
    pc = ParallelConfig.parse("dp_replicate=2,dp_shard=2,tp=2")
    assert ParallelConfig.parse(str(pc)) == pc
    assert pc.short() == "dp_replicate=2,dp_shard=2,tp=2"
    assert ParallelConfig().short() == "dp_shard=1"
    assert pc.dp_size == 4 and pc.mesh_shape == (2, 2, 2)


def test_rank_order_is_tp_fastest():
    pc = ParallelConfig(2, 3, 2)
    for rank in range(pc.world_size):
        r, s, t = pc.coords(rank)
        assert rank == (r * 3 + s) * 2 + t == pc.rank_of(r, s, t)
    with pytest.raises(ValueError, match="outside a world of 12"):
        pc.coords(12)


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "written like"),
        ("dp=2", "cannot parse 'dp=2'"),
        ("tp=2,tp=4", "gives tp twice"),
        ("tp=0", "tp must be a positive integer"),
        ("dp_shard=-1", "dp_shard must be a positive integer"),
        ("tp=two", "cannot parse"),
    ],
)
def test_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig.parse(text)


def test_validate_world_size():
    with pytest.raises(ValueError, match=r"needs dp_replicate\*dp_shard\*tp = 4 devices, but there are 3"):
        ParallelConfig.parse("dp_shard=2,tp=2").validate(world_size=3)
    ParallelConfig.parse("dp_shard=3").validate(world_size=3)


@pytest.mark.parametrize(
    "model,tp,what",
    [
        ("debug", 3, "n_heads=8"),       # heads 8
        ("llama3-8b", 16, "n_kv_heads=8"),  # 32 heads ok, 8 KV heads not
        ("125m", 12, "n_kv_heads=4"),
    ],
)
def test_validate_tp_against_model(model, tp, what):
    with pytest.raises(ValueError, match=f"tp={tp} does not divide {what}"):
        ParallelConfig(tp=tp).validate(get_model_config(model))


def test_validate_tp_against_ffn():
    cfg = get_model_config("debug").with_overrides(ffn_dim=770)
    with pytest.raises(ValueError, match="does not divide ffn_dim=770"):
        ParallelConfig(tp=4).validate(cfg)


def test_valid_layouts_pass():
    cfg = get_model_config("llama3-70b")
    assert ParallelConfig(dp_shard=16, tp=8).validate(cfg, 128).tp == 8


def test_ep_is_carved_from_dp_shard_and_checked_against_the_experts():
    from dynatrain.models.moe_configs import MOE_CONFIGS

    pc = ParallelConfig.parse("dp_replicate=2,dp_shard=4,tp=2,ep=2")
    assert pc.world_size == 16 and pc.dp_size == 8 and pc.efsdp == 2
    assert pc.mesh_shape == (2, 2, 2, 2) and pc.mesh_dim_names == ("dp_replicate", "efsdp", "ep", "tp")
    assert pc.root_dims("dp_shard") == (1, 2) and pc.root_dims("tp") == (3,)
    assert pc.flattened_dims()["data_parallel"] == ("dp_replicate", "efsdp", "ep")
    assert ParallelConfig.parse(str(pc)) == pc and pc.short() == "dp_replicate=2,dp_shard=4,tp=2,ep=2"
    # positions keep the (dp_replicate, dp_shard, tp) order: ep changes what a position holds, not who holds it
    assert pc.coords(5) == ParallelConfig(2, 4, 2).coords(5)
    with pytest.raises(ValueError, match="ep=3 takes its ranks from dp_shard"):
        ParallelConfig.parse("dp_shard=4,ep=3")
    with pytest.raises(ValueError, match="ep=2 splits routed experts, and model 'debug' has none"):
        ParallelConfig.parse("dp_shard=2,ep=2").validate(get_model_config("debug"))
    with pytest.raises(ValueError, match="ep=16 does not divide n_experts=8"):
        ParallelConfig.parse("dp_shard=16,ep=16").validate(MOE_CONFIGS["moe-debug"])
    ParallelConfig.parse("dp_shard=8,ep=8").validate(MOE_CONFIGS["moe-debug"])


def test_pipeline_stages_lead_the_mesh():
    pcfg = ParallelConfig.parse("pp=2,dp_shard=2,tp=2")
    assert pcfg.world_size == 8 and pcfg.stage_size == 4 and pcfg.dp_size == 2
    assert pcfg.mesh_shape == (2, 1, 2, 2) and pcfg.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert [pcfg.stage_of(q) for q in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert pcfg.coords(5) == (0, 0, 1) and pcfg.rank_of(0, 0, 1, p=1) == 5
    assert str(pcfg) == "pp=2,dp_replicate=1,dp_shard=2,tp=2" and pcfg.short() == "pp=2,dp_shard=2,tp=2"
    assert ParallelConfig.parse(str(pcfg)) == pcfg and pcfg.without_pp() == ParallelConfig(dp_shard=2, tp=2)
    with_ep = ParallelConfig.parse("pp=2,dp_shard=4,ep=2")
    assert with_ep.mesh_dim_names == ("pp", "dp_replicate", "efsdp", "ep", "tp")
    assert with_ep.root_dims("dp_shard") == (2, 3)


def test_pipeline_needs_a_layer_per_stage():
    from dynatrain.models.configs import MODEL_CONFIGS

    with pytest.raises(ValueError, match="pp=8 needs at least one layer per stage.*has 4: choose pp <= 4"):
        ParallelConfig.parse("pp=8").validate(MODEL_CONFIGS["debug"])
    with pytest.raises(ValueError, match=r"needs pp\*dp_replicate\*dp_shard\*tp = 4 devices"):
        ParallelConfig.parse("pp=2,dp_shard=2").validate(world_size=2)
