import pytest
import torch

from dynatrain.models.configs import MODEL_CONFIGS, ModelConfig, get_model_config
from dynatrain.models.init import init_slice, rows_per_block
from dynatrain.models.llama import Transformer
from dynatrain.models.tp_styles import tp_shard_dim, tp_style

EXPECTED_PARAMS = {  # from the published shapes; the small ones from our own configs
    "llama3-70b": 70.6e9,
    "llama3-8b": 8.03e9,
}


@pytest.mark.parametrize("name", list(MODEL_CONFIGS))
def test_meta_model_matches_config_shapes(name):
    cfg = MODEL_CONFIGS[name]
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes == cfg.param_shapes()
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    for pname in shapes:
        tp_style(pname)  # every parameter has a TP rule


@pytest.mark.parametrize("name,expected", EXPECTED_PARAMS.items())
def test_published_llama3_sizes(name, expected):
    assert abs(MODEL_CONFIGS[name].num_params() - expected) / expected < 0.01


def test_llama3_70b_shape():
    c = MODEL_CONFIGS["llama3-70b"]
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim) == (128256, 8192, 80, 64, 8, 28672)
    c = MODEL_CONFIGS["llama3-8b"]
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim) == (128256, 4096, 32, 32, 8, 14336)


def test_small_configs_have_expected_scale():
    assert 1e6 < MODEL_CONFIGS["debug"].num_params() < 10e6
    assert abs(MODEL_CONFIGS["125m"].num_params() - 125e6) / 125e6 < 0.05
    assert abs(MODEL_CONFIGS["350m"].num_params() - 350e6) / 350e6 < 0.05
    assert abs(MODEL_CONFIGS["1b"].num_params() - 1.1e9) / 1.1e9 < 0.05


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="unknown model 'gpt5'.*debug"):
        get_model_config("gpt5")


def test_bad_model_config_is_refused():
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig("x", dim=100, n_layers=1, n_heads=3, n_kv_heads=1, vocab_size=10, ffn_dim=10)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig("x", dim=96, n_layers=1, n_heads=6, n_kv_heads=4, vocab_size=10, ffn_dim=10)


def test_tp_plan():
    assert tp_shard_dim("layers.0.attention.wq.weight") == 0
    assert tp_shard_dim("layers.11.feed_forward.w2.weight") == 1
    assert tp_shard_dim("tok_embeddings.weight") == 0
    assert tp_shard_dim("layers.3.ffn_norm.weight") is None
    assert tp_style("output.weight") == "colwise"
    with pytest.raises(KeyError):
        tp_style("layers.0.attention.bias")


@pytest.mark.parametrize("shape,box", [((40000, 40), ((10, 3), (39000, 20))), ((70000, 16), ((65530, 0), (4470, 16)))])
def test_init_slice_is_the_slice_of_the_full_tensor(shape, box):
    (o0, o1), (n0, n1) = box
    full = init_slice("w", shape, (0, 0), shape, 0.02, seed=7)
    part = init_slice("w", shape, (o0, o1), (n0, n1), 0.02, seed=7)
    assert rows_per_block(shape) < shape[0]  # the slice crosses generator blocks
    assert torch.equal(part, full[o0:o0 + n0, o1:o1 + n1])


def test_model_forward_and_init_are_deterministic():
    cfg = MODEL_CONFIGS["debug"].with_overrides(n_layers=2)
    a, b = Transformer(cfg), Transformer(cfg)
    a.init_weights()
    b.init_weights()
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = a(tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    # causal: changing a later token leaves earlier logits untouched
    t2 = tokens.clone()
    t2[:, -1] = (t2[:, -1] + 1) % cfg.vocab_size
    assert torch.allclose(a(t2)[:, :-1], logits[:, :-1], atol=1e-6)
