"""What code written for Lightning's ModelParallelStrategy expects: its size arguments and their "auto", its error
type for a layout that does not fit, its refusal of the old FSDP API; and a user's own `model_config` attribute is
never taken for a zoo config."""

import pytest
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from dynatrain.models.configs import get_model_config
from dynatrain.models.registry import zoo_config_of
from dynatrain.strategies.dynatrain import DynaTrainStrategy
from dynatrain.strategies.lightning_compat import refuse_fsdp1
from dynatrain.vps.parallel_config import LayoutError, ParallelConfig


@pytest.mark.parametrize("sizes,nodes,per_node,expected", [
    ({"tensor_parallel_size": "auto"}, 1, 4, "tp=4"),  # Lightning's default: tp over a node, dp across nodes
    ({"data_parallel_size": "auto"}, 2, 2, "dp_shard=2,tp=2"),
    ({"data_parallel_size": 4, "tensor_parallel_size": 1}, 1, 4, "dp_shard=4"),
    ({"data_parallel_size": 2}, 2, 2, "dp_shard=2,tp=2"),
])
def test_lightning_sizes_mean_what_they_mean_in_model_parallel_strategy(sizes, nodes, per_node, expected):
    assert DynaTrainStrategy(**sizes).requested_layout(nodes, per_node).short() == expected
    assert DynaTrainStrategy().requested_layout(nodes, per_node).short() == f"dp_shard={nodes * per_node}"


def test_a_layout_that_does_not_fit_is_lightnings_runtime_error_and_a_value_error():
    with pytest.raises(RuntimeError, match=r"`data_parallel_size=4` and\s+`tensor_parallel_size=2` multiplied "
                                           r"should equal the world size \(4\)"):
        ParallelConfig.from_lightning_sizes(4, 2, 1, 4)
    with pytest.raises(LayoutError) as err:
        ParallelConfig(dp_shard=2, tp=2).validate(get_model_config("debug"), 8)
    assert isinstance(err.value, ValueError) and isinstance(err.value, RuntimeError)
    with pytest.raises(RuntimeError, match="tp=3 does not divide n_heads"):
        ParallelConfig(tp=3).validate(get_model_config("debug"))
    with pytest.raises(ValueError, match="give one of them"):
        DynaTrainStrategy(parallel="tp=2", tensor_parallel_size=2)


def test_a_users_model_config_attribute_is_not_the_zoos():
    from dynatrain.models.llama import Transformer

    module = nn.Module()
    module.model_config = {"n_heads": 3}  # a user's own dict (or a Hugging Face config) under the same name
    assert zoo_config_of(module) is None
    module.model_config = get_model_config("debug")
    assert zoo_config_of(module) is module.model_config
    holder = nn.Module()
    holder.model_config = {"n_heads": 3}
    holder.net = Transformer(get_model_config("debug").with_overrides(n_layers=1, dim=64, vocab_size=64))
    assert zoo_config_of(holder) is holder.net.config  # a zoo model it holds says what it is


def test_modules_wrapped_by_the_old_fsdp_api_are_refused_as_lightning_refuses_them():
    module = nn.Sequential(nn.Linear(2, 2))
    refuse_fsdp1(module, "DynaTrainStrategy")
    # FSDP1 cannot be built on a CPU-only machine; an instance of its class is what the guard looks for.
    wrapped = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapped)
    module.append(wrapped)
    with pytest.raises(TypeError, match="Found modules that are wrapped with .*FullyShardedDataParallel"):
        refuse_fsdp1(module, "DynaTrainStrategy")
