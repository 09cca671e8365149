"""Split a model into pipeline stages: a rank keeps the layers of its stages, and one *view* per stage runs them.

What a model must offer to be split (torchtitan's convention, which the zoo's `Transformer` follows):
- its blocks in an ``nn.ModuleDict`` called ``layers``, in execution order;
- children registered before ``layers`` run before the blocks (the embedding: first stage only), children
  registered after it run after them (final norm, output projection: last stage only);
- a ``forward`` that skips a child set to None and iterates ``self.layers.values()``: the first stage takes the
  model's inputs, the others take the previous stage's output.

The rank's model keeps its own parameter names (``layers.7.attention.wq.weight`` stays that on any stage), which is
what lets a switch move a layer between stages by name. A view is a second module object over the same children:
``layers`` restricted to one stage's blocks, the children of other stages None. It is not registered in the model,
so it adds no parameter names; FSDP2 makes each view a root (its own embedding or head, its blocks beneath), which
is what `torch.distributed.pipelining` expects of a stage module.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dynatrain.models.stage_split import rank_stages

PIPELINE_ATTR = "pipeline_stages"  # where a split model keeps its `PipelineStages`


@dataclass
class PipelineStages:
    """The stages a rank runs: global stage ids (ascending), their views, and the number of stages in all."""

    stage_ids: tuple[int, ...]
    views: list[nn.Module]
    n_stages: int
    split: tuple[tuple[int, int], ...]


def _edges(model: nn.Module) -> tuple[list[str], list[str]]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(
            f"{type(model).__name__} cannot be split into pipeline stages: it needs its blocks in an nn.ModuleDict "
            "called `layers` (children before it run on the first stage, children after it on the last), and a "
            "forward that skips children set to None"
        )
    names = list(model._modules)
    at = names.index("layers")
    return names[:at], names[at + 1:]


def stage_view(model: nn.Module, keys: list[str], first: bool, last: bool) -> nn.Module:
    """A module of the model's class over the same children: blocks ``keys`` only, the embedding when ``first``,
    the head when ``last``. Parameters and buffers are shared, hooks are its own."""
    before, after = _edges(model)
    view = object.__new__(type(model))
    nn.Module.__init__(view)
    internal = set(view.__dict__)
    for k, v in model.__dict__.items():
        if k not in internal:
            view.__dict__[k] = v  # plain attributes (the config, say)
    # The same dicts, not copies: a buffer the model recomputes after materialising is the view's too.
    view._parameters = model._parameters
    view._buffers = model._buffers
    view._non_persistent_buffers_set = model._non_persistent_buffers_set
    for name, child in model._modules.items():
        if name == "layers":
            view._modules[name] = nn.ModuleDict({k: model.layers[k] for k in keys})
        elif name in before:
            view._modules[name] = child if first else None
        elif name in after:
            view._modules[name] = child if last else None
        else:
            view._modules[name] = child
    view.training = model.training
    return view


def split_model(model: nn.Module, split: tuple[tuple[int, int], ...], pp: int, coordinate: int,
                stages_per_rank: int = 1) -> PipelineStages:
    """Keep only the layers (and embedding / head) of the stages pp coordinate ``coordinate`` runs, in place, and
    return their views. ``split`` gives each of the ``pp * stages_per_rank`` stages its ``[lo, hi)`` layers."""
    before, after = _edges(model)
    if len(split) != pp * stages_per_rank:
        raise ValueError(f"a split of {len(split)} stages for pp={pp} with {stages_per_rank} stage(s) per rank")
    keys = list(model.layers.keys())
    if split[-1][1] != len(keys):
        raise ValueError(f"the split covers {split[-1][1]} layers, the model has {len(keys)}")
    stage_ids = rank_stages(pp, stages_per_rank, coordinate)
    n_stages = len(split)
    kept = {keys[i] for s in stage_ids for i in range(*split[s])}
    for k in keys:
        if k not in kept:
            del model.layers[k]
    for name in before:
        if 0 not in stage_ids:
            setattr(model, name, None)
    for name in after:
        if n_stages - 1 not in stage_ids:
            setattr(model, name, None)
    views = [stage_view(model, keys[split[s][0]:split[s][1]], s == 0, s == n_stages - 1) for s in stage_ids]
    stages = PipelineStages(stage_ids, views, n_stages, tuple(split))
    model.__dict__[PIPELINE_ATTR] = stages  # a plain attribute: the views add no parameter names
    return stages


def pipeline_stages(module: nn.Module) -> PipelineStages | None:
    """The `PipelineStages` of the (one) split model inside ``module``, or None."""
    found = [m.__dict__[PIPELINE_ATTR] for m in module.modules() if PIPELINE_ATTR in m.__dict__]
    if len(found) > 1:
        raise ValueError(f"{len(found)} split models in one module: a pipeline runs one")
    return found[0] if found else None
