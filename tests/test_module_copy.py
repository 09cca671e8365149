"""The copy a target layout is built from: the module tree on meta; attributes copied, or shared where a copy is
impossible (a tensor with autograd history, a lock, a file handle) instead of failing fit."""

import threading

import lightning.pytorch as pl
import torch
from torch import nn

from dynatrain.switch.module_copy import meta_copy


class Holder(pl.LightningModule):
    def __init__(self, handle) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.register_buffer("scale", torch.ones(2))
        self.sizes = {"heads": 2, "hidden": [4, 8]}
        x = torch.ones(3, requires_grad=True)
        self.previous = x * 2  # a tensor with autograd history: torch refuses to deep-copy it
        self.kept = [{"a": 1}, x * 3]  # a container that holds one
        self.lock = threading.Lock()
        self.handle = handle


def test_a_module_holding_what_cannot_be_copied_is_copied_with_it_shared(tmp_path):
    with open(tmp_path / "log.txt", "w") as handle:
        live = Holder(handle)
        copy = meta_copy(live)
    assert all(p.is_meta for p in copy.parameters()) and all(b.is_meta for b in copy.buffers())
    assert not any(p.is_meta for p in live.parameters())
    assert [n for n, _ in copy.named_parameters()] == [n for n, _ in live.named_parameters()]
    assert copy.lock is live.lock and copy.handle is live.handle and copy.kept is live.kept
    assert copy.previous is live.previous  # shared: a build reads no tensor it would have to pay a copy for
    # what can be copied is a copy: the build may change it without touching the live module
    assert copy.sizes == live.sizes and copy.sizes is not live.sizes
    assert copy.sizes["hidden"] is not live.sizes["hidden"]
    assert copy.net is not live.net and copy.net[0] is not live.net[0]
    copy.net[0].register_forward_hook(lambda *a: None)
    assert not live.net[0]._forward_hooks


def test_a_tied_parameter_and_a_module_registered_twice_stay_one_in_the_copy():
    live = nn.Module()
    live.embed = nn.Embedding(8, 4)
    live.head = nn.Linear(4, 8, bias=False)
    live.head.weight = live.embed.weight
    live.alias = live.head
    copy = meta_copy(live)
    assert copy.head.weight is copy.embed.weight and copy.head.weight.is_meta
    assert copy.alias is copy.head


def test_a_copy_of_the_copy_shares_what_the_first_shared():
    lock = threading.Lock()
    live = nn.Linear(2, 2)
    live.lock = lock
    live._device_mesh = object()  # a mesh keeps its world's groups alive: never carried into the copy
    first = meta_copy(live)
    second = meta_copy(first)
    assert first._device_mesh is None and second.lock is lock and second.weight is not first.weight


def test_to_meta_and_fill_target_keep_a_tied_parameter_one():
    from dynatrain.switch.adopt import fill_target
    from dynatrain.switch.target import to_meta

    def tied() -> nn.Module:
        holder = nn.Module()
        holder.net = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
        holder.net[1].weight = holder.net[0].weight
        return holder

    joiner = tied()
    to_meta(joiner)  # what a joining process holds before its shards arrive
    assert joiner.net[1].weight is joiner.net[0].weight and joiner.net[0].weight.is_meta
    moved = torch.arange(32.0).view(8, 4)
    target = meta_copy(tied())
    fill_target(target, {"net.0.weight": moved}, torch.device("cpu"))  # the tied tensor arrives once
    assert target.net[1].weight is target.net[0].weight and torch.equal(target.net[1].weight, moved)
