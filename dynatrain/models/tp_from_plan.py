"""Tensor parallelism from a model's own plan: module-name patterns to style names, as Hugging Face models carry
them (``model._tp_plan``, ``config.base_model_tp_plan``) or as a user passes them (the strategy's ``tp_plan=``),
mapped to torch's `ParallelStyle`s.

A plan that cannot serve a tp degree (a split width or a head count tp does not divide, a pattern that names no
module, a style torch has no counterpart for here) raises ValueError saying so: the strategy runs this on the meta
device when a layout is requested, so such a layout is refused then, with this reason, and nothing changes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module


def _style(name: str):
    """A fresh torch style for a plan's style name (styles hold per-module state: one per module)."""
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Replicate())
    if name in ("embedding_rowwise", "rowwise_rep"):
        return RowwiseParallel(input_layouts=Replicate())
    if name == "sequence_parallel":
        return SequenceParallel()
    raise ValueError(f"tensor-parallel style {name!r} has no torch counterpart here; use one of {', '.join(STYLES)}")


STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise", "rowwise_rep",
          "sequence_parallel")

# The weight dimension each style splits: nn.Linear is [out, in], nn.Embedding [num, dim]. None: nothing split.
_SPLIT_DIM = {"colwise": 0, "colwise_gather_output": 0, "colwise_rep": 0, "rowwise": 1, "rowwise_rep": 1,
              "embedding_rowwise": 0, "sequence_parallel": None}
_COLWISE_EMBEDDING = 1  # a column-split embedding splits its [num, dim] weight's dim


def model_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan a Hugging Face model carries, keyed from ``model``: its ``_tp_plan``, else its config's
    ``base_model_tp_plan`` (keyed from its base model); None when it has neither."""
    plan = getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None)
    if not base_plan:
        return None
    base = getattr(model, "base_model", model)
    prefix = next((n for n, m in model.named_modules() if m is base), "")
    return {f"{prefix}.{k}" if prefix else k: v for k, v in base_plan.items()}


def expand(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Every module of ``model`` a plan names (``*`` stands for one name part, such as a layer index), with its
    style; ValueError for a pattern that names no module, or an unknown style."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in _SPLIT_DIM:
            _style(style)  # raises with the known styles
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        hits = [n for n in names if regex.fullmatch(n)]
        if not hits:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} names no module of {type(model).__name__}")
        for n in hits:
            out[n] = style
    return out


def check_plan(model: nn.Module, modules: Mapping[str, str], tp: int) -> None:
    """ValueError naming the first width or head count ``tp`` does not divide."""
    # Heads first: a width tp does not divide is most often a head count it does not divide.
    for m in model.modules():
        config = getattr(m, "config", None)
        for field in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, field, None)
            if isinstance(heads, int) and heads % tp:
                raise ValueError(f"tp={tp} does not divide {field}={heads} of {type(m).__name__}: choose a tp that "
                                 f"divides {heads}")
    for name, style in modules.items():
        module = model.get_submodule(name)
        dim = _SPLIT_DIM[style]
        weight = getattr(module, "weight", None)
        if dim is None or weight is None:
            continue
        if isinstance(module, nn.Embedding) and style == "colwise":
            dim = _COLWISE_EMBEDDING
        size = weight.shape[dim]
        if size % tp:
            raise ValueError(f"tp={tp} does not divide {name} ({style}): its weight's dim {dim} has {size}; choose a "
                             f"tp that divides {size}")


def apply_plan(model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, str]) -> None:
    """Split ``model``'s modules over ``tp_mesh`` as ``plan`` says (checked first by `check_plan`)."""
    modules = expand(model, plan)
    check_plan(model, modules, tp_mesh.size())
    parallelize_module(model, tp_mesh, {name: _style(style) for name, style in modules.items()})

