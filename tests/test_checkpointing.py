"""Activation checkpointing of the zoo's blocks (one process): the policies, names untouched, gradients and MoE
router state equal to the plain model's."""

import pytest
import torch
import torch.nn.functional as F

from dynatrain.models.checkpointing import ActivationCheckpointing, apply_ac, is_checkpointed
from dynatrain.models.llama import Transformer
from dynatrain.models.moe import MoETransformer
from dynatrain.models.pipeline_split import split_model
from dynatrain.models.specs import get_zoo_config


@pytest.mark.parametrize("text,expected", [
    ("none", ActivationCheckpointing()), (None, ActivationCheckpointing()), (False, ActivationCheckpointing()),
    ("full", ActivationCheckpointing("full")), (True, ActivationCheckpointing("full")),
    ("selective", ActivationCheckpointing("selective", per_op=True)),
    ("selective:op", ActivationCheckpointing("selective", per_op=True)),
    ("Selective:3", ActivationCheckpointing("selective", every=3)),
])
def test_policies_parse(text, expected):
    assert ActivationCheckpointing.parse(text) == expected
    assert ActivationCheckpointing.parse(str(expected)) == expected


@pytest.mark.parametrize("bad", ["selective:0", "selective:x", "some", "full:2"])
def test_a_bad_policy_says_what_to_write(bad):
    with pytest.raises(ValueError, match="'none', 'full', 'selective:op'"):
        ActivationCheckpointing.parse(bad)


def _model(name="debug", n_layers=2):
    cfg = get_zoo_config(name).with_overrides(n_layers=n_layers)
    model = (MoETransformer if name.startswith("moe") else Transformer)(cfg)
    model.init_weights()
    return model


def test_every_nth_block_by_its_index_in_the_whole_model_and_names_unchanged():
    plain, model = _model(n_layers=4), _model(n_layers=4)
    assert apply_ac(model, "selective:2") == ["1", "3"]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(model.state_dict()) == list(plain.state_dict())
    assert apply_ac(model, "selective:2") == ["1", "3"] and is_checkpointed(model.layers["1"])  # again: no change
    assert not is_checkpointed(model.layers["0"])
    # A pipeline stage holding layers 2 and 3 picks the same block as the whole model.
    stage = _model(n_layers=4)
    split_model(stage, ((0, 2), (2, 4)), pp=2, coordinate=1)
    assert apply_ac(stage, "selective:2") == ["3"]


def _step(model, moe=False):
    tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    if moe:
        loss = loss + model.aux_loss()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    state = {n: b.clone() for n, b in model.named_buffers()}
    return loss.detach(), grads, state


@pytest.mark.parametrize("name", ["debug", "moe-debug"])
@pytest.mark.parametrize("policy", ["full", "selective:op", "selective:2"])
def test_gradients_and_router_state_equal_the_plain_models(name, policy):
    moe = name.startswith("moe")
    loss, grads, state = _step(_model(name), moe)
    model = _model(name)
    assert apply_ac(model, policy)
    got_loss, got_grads, got_state = _step(model, moe)
    assert torch.equal(got_loss, loss)
    for n, g in grads.items():
        assert torch.equal(got_grads[n], g), n
    # The recomputation in the backward leaves the routers' token counts (and every other buffer) as the forward did.
    for n, b in state.items():
        assert torch.equal(got_state[n], b), n
    if moe:
        assert all(layer.moe.aux_loss.grad_fn is not None for layer in model.layers.values())


def test_a_model_without_blocks_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="checkpoint_block"):
        apply_ac(torch.nn.Linear(2, 2), "full")


def test_the_op_policy_with_expert_parallelism_is_refused_with_what_to_use():
    from dynatrain.models.parallelize import ParallelizeOptions
    from dynatrain.models.parallelize_moe import parallelize_moe
    from dynatrain.vps.parallel_config import ParallelConfig

    options = ParallelizeOptions(activation_checkpointing=ActivationCheckpointing.parse("selective:op"))
    with pytest.raises(ValueError, match="use 'full' or 'selective:N'"):
        parallelize_moe(_model("moe-debug"), None, ParallelConfig(dp_shard=2, ep=2), options)
