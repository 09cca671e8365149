"""On CUDA the strategy's groups carry CPU tensors too (the requests' agreement, batch fingerprints): gloo for CPU
tensors beside NCCL, unless the user names a backend."""

import torch

import dynatrain


def _on(device: str, **kwargs):
    strategy = dynatrain.DynaTrainStrategy(**kwargs)
    strategy._device = torch.device(device)  # where an elastic process keeps its device
    return strategy


def test_cuda_groups_take_gloo_for_cpu_tensors_beside_nccl():
    assert _on("cuda:0")._get_process_group_backend() == "cpu:gloo,cuda:nccl"


def test_a_backend_the_user_names_is_kept_and_cpu_stays_gloo():
    assert _on("cuda:0", process_group_backend="nccl")._get_process_group_backend() == "nccl"
    assert _on("cpu")._get_process_group_backend() == "gloo"
