"""A copy of a user's module for building target layouts: its module tree with every parameter and buffer on the
meta device, and its other attributes copied where they can be and shared where they cannot.

A target build runs the module's own parallelisation (`configure_model()`, or the strategy's) on this copy, so the
copy needs the module tree and the plain values that parallelisation reads (sizes, flags, configs). A user's
module may hold anything else beside them: tensors with autograd history (torch refuses to deep-copy a non-leaf
tensor), locks, file handles, a logger's run. Copying the whole object would fail `fit` over an attribute no build
reads, so an attribute that cannot be deep-copied is shared with the live module instead, and a plain tensor
attribute is always shared (copying it would cost its memory for nothing a build reads).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

# The attributes of an nn.Module that make up its tree: rebuilt, never copied as values.
_TREE = ("_parameters", "_buffers", "_modules")


def meta_copy(module: nn.Module, keep: tuple = ()) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors; objects in ``keep`` (the trainer) are
    shared, not copied. The copy holds no device mesh: a mesh keeps its process groups alive, and a group that
    outlives its world keeps a survivor's peers blocked in it."""
    memo: dict[int, object] = {id(obj): obj for obj in keep if obj is not None}
    mesh = getattr(module, "_device_mesh", None)
    if mesh is not None:
        memo[id(mesh)] = None
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return _copy_module(module, memo)


def _copy_module(module: nn.Module, memo: dict[int, object]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]  # a module registered twice stays one module
    new = module.__class__.__new__(module.__class__)
    memo[id(module)] = new
    state = {}
    for key, value in module.__dict__.items():
        if key not in _TREE:
            state[key] = _copy_value(value, memo)
    state["_parameters"] = {n: None if p is None else memo[id(p)] for n, p in module._parameters.items()}
    state["_buffers"] = {n: None if b is None else memo[id(b)] for n, b in module._buffers.items()}
    state["_modules"] = {n: None if c is None else _copy_module(c, memo) for n, c in module._modules.items()}
    new.__dict__.update(state)
    return new


def _copy_value(value, memo: dict[int, object]):
    """A deep copy of an attribute's value, or the value itself where a copy is impossible or pointless."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, nn.Module):
        return _copy_module(value, memo)
    if isinstance(value, torch.Tensor):
        return value
    before = len(memo)
    try:
        return copy.deepcopy(value, memo)
    except Exception:  # noqa: BLE001 - whatever the object refuses, the build does not need a copy of it
        # deepcopy registers a container before its items: drop the half-made copies the failure left behind.
        for key in list(memo)[before:]:
            del memo[key]
        memo[id(value)] = value
        return value
