"""Training's groups take the device's backend (NCCL on CUDA, as Lightning chooses); metadata has a gloo group of
its own (`dynatrain.runtime.control_group`), whose functions are the identity of a world of one."""

import torch

import dynatrain
from dynatrain.runtime import control_group


def _on(device: str, **kwargs):
    strategy = dynatrain.DynaTrainStrategy(**kwargs)
    strategy._device = torch.device(device)  # where an elastic process keeps its device
    return strategy


def test_training_groups_take_the_device_backend_and_a_named_one_is_kept():
    assert _on("cuda:0")._get_process_group_backend() == "nccl"
    assert _on("cpu")._get_process_group_backend() == "gloo"
    assert _on("cuda:0", process_group_backend="cpu:gloo,cuda:nccl")._get_process_group_backend() == \
        "cpu:gloo,cuda:nccl"


def test_the_control_channel_without_a_world_returns_this_process_values():
    assert control_group.new_control_group() is None
    assert control_group.all_reduce_ints([3, -4], None) == [3, -4]
    assert control_group.sum_ints([3, -4], None) == [3, -4]
    assert control_group.all_reduce_floats([0.5], None) == [0.5]
    assert control_group.all_gather_ints([1, 2], None) == [[1, 2]]
    assert control_group.all_gather_object({"a": (1, "x")}, None) == [{"a": (1, "x")}]
    data = torch.arange(5, dtype=torch.uint8)
    assert torch.equal(control_group.all_gather_bytes(data, None), data)
