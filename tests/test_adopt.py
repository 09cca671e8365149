"""After the transfer, the target model takes the moved tensors as its shards: no second copy of the weights, and
FSDP2 gathers from them (and from what the optimizer writes into them) from the first step on."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dynatrain.switch.adopt import fill_target


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(6, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.b(self.a(x)) * self.scale


def meta_target() -> Net:
    mesh = init_device_mesh("cpu", (1,))
    with torch.device("meta"):
        net = Net()
    fully_shard(net.a, mesh=mesh)
    fully_shard(net.b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def moved_states(net: Net) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {n: torch.randn(p.shape, generator=g) for n, p in net.named_parameters()}
    out["scale"] = torch.full((4,), 2.0)
    return out


def reference(x, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((x @ w["a.weight"].T + w["a.bias"]) @ w["b.weight"].T + w["b.bias"]) * w["scale"]


def test_moved_tensors_become_the_shards(one_process_group):
    net = meta_target()
    moved = moved_states(net)
    dst = dict(moved)
    fill_target(net, dst, torch.device("cpu"))
    assert dst == {}
    for name, p in net.named_parameters():
        assert isinstance(p, DTensor) and not p.is_meta
        assert p.to_local().data_ptr() == moved[name].data_ptr(), name
    assert net.scale.data_ptr() == moved["scale"].data_ptr()

    x = torch.randn(3, 8)
    assert torch.equal(net(x), reference(x, moved))
    net(x).sum().backward()
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    # The optimizer wrote into the moved tensors, and the next forward gathers from them.
    for name, p in net.named_parameters():
        assert p.to_local().data_ptr() == moved[name].data_ptr(), name
    assert torch.equal(net(x), reference(x, moved))


def test_parameters_stay_the_same_objects_when_torch_swaps_on_conversion(one_process_group):
    # With this flag `to_empty` keeps each parameter object (and FSDP2 then requires it): so must the adoption.
    net = meta_target()
    moved = moved_states(net)
    before = {name: id(p) for name, p in net.named_parameters()}
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        fill_target(net, dict(moved), torch.device("cpu"))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    for name, p in net.named_parameters():
        assert id(p) == before[name] and p.to_local().data_ptr() == moved[name].data_ptr(), name
    x = torch.randn(3, 8)
    net(x).sum().backward()
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    assert torch.equal(net(x), reference(x, moved))


def test_tensors_that_cannot_be_shards_are_copied(one_process_group):
    net = meta_target()
    moved = moved_states(net)
    dst = dict(moved)
    dst["a.weight"] = moved["a.weight"].T.contiguous().T  # the same values, not contiguous
    dst["b.bias"] = moved["b.bias"].double()
    fill_target(net, dst, torch.device("cpu"))
    weight, bias = net.a.weight.to_local(), net.b.bias.to_local()
    assert weight.is_contiguous() and weight.data_ptr() != moved["a.weight"].data_ptr()
    assert bias.dtype == torch.float32
    x = torch.randn(3, 8)
    assert torch.equal(net(x), reference(x, moved))


def test_a_moved_tensor_of_another_shape_is_refused(one_process_group):
    net = meta_target()
    dst = moved_states(net)
    dst["b.weight"] = torch.zeros(3, 6)
    with pytest.raises(RuntimeError, match=r"b\.weight: the switch produced \(3, 6\), the target holds \(4, 6\)"):
        fill_target(net, dst, torch.device("cpu"))
