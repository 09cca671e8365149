"""torch.compile per block (one process): the option's values, names untouched, the same gradients as eager, and
the compile clock. The backend here is aot_eager: inductor's C++ code generation for one debug block takes about
35 s of CPU on this machine's 2 cores, too long for `make test`; it is what the option uses by default."""

import pytest
import torch
import torch.nn.functional as F

from dynatrain.models.checkpointing import apply_ac
from dynatrain.models.compile import apply_compile, compile_backend, compile_seconds, is_compiled
from dynatrain.models.llama import Transformer
from dynatrain.models.specs import get_zoo_config


@pytest.mark.parametrize("value,expected", [
    (False, None), (None, None), ("off", None), ("false", None), (True, "inductor"), ("true", "inductor"),
    ("inductor", "inductor"), ("aot_eager", "aot_eager"),
])
def test_the_option_names_a_backend(value, expected):
    assert compile_backend(value) == expected


def test_an_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match="aot_eager.*inductor"):
        compile_backend("fastest")


def _model():
    model = Transformer(get_zoo_config("debug").with_overrides(n_layers=2))
    model.init_weights()
    return model


def _grads(model):
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.timeout(240)
def test_compiled_blocks_with_checkpointing_give_the_eager_gradients_and_keep_their_names():
    reference = _grads(_model())
    model = _model()
    apply_ac(model, "selective:op")
    assert apply_compile(model, "aot_eager") == ["0", "1"]
    assert all(is_compiled(b) for b in model.layers.values())
    assert list(dict(model.named_parameters())) == list(reference)
    before = compile_seconds()
    grads = _grads(model)
    assert compile_seconds() > before  # forward and backward compiled here, and counted
    for name, g in reference.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert apply_compile(model, None) == []
