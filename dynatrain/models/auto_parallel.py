"""The default parallelisation of a module its author did not parallelise (no `configure_model()`, no
``parallelize_fn``): the zoo's models it holds by their kind's ``parallelize_fn`` (`models.registry`); a user's or
Hugging Face model, which has no kind, as Lightning's ``strategy="fsdp"`` with an auto-wrap policy does, on FSDP2,
for every layout.

Each parameter-holding child of the LightningModule is a root; in it every repeated block gets its own
`fully_shard`, then the root. Blocks are, in order: the strategy's ``block_types`` (classes or class names), the
classes a Hugging Face model names in ``_no_split_modules``, else the element classes of the largest
`nn.ModuleList`. With tp > 1, tensor parallelism first, from the plan the strategy was given or the model carries
(`plan_tp`). Parameters that are one tensor (tied embeddings) stay one: tied again after TP split each user, and
no block that holds one gets a unit of its own while a module outside it uses the tensor too (both users then see
it gathered by their common root).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dynatrain.models.decoder import Decoder
from dynatrain.models.parallelize import ParallelizeOptions, dense_meshes
from dynatrain.models.registry import spec_for
from dynatrain.models.tp_from_plan import apply_plan, model_plan
from dynatrain.vps.parallel_config import ParallelConfig

_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(frozen=True)
class AutoOptions:
    block_types: tuple = ()  # classes or class names of the blocks that get their own FSDP unit
    tp_plan: Mapping[str, str] | None = None  # module-name patterns (from the LightningModule) -> style names
    mp_policy: MixedPrecisionPolicy | None = None
    reshard_after_forward: bool = True


def mp_policy_for(precision: str | None, explicit: MixedPrecisionPolicy | None) -> MixedPrecisionPolicy | None:
    """The FSDP2 mixed precision of Lightning's ``precision`` flag (``"bf16-mixed"``: parameters gathered in bf16,
    gradients reduced in fp32); a policy the strategy was given wins."""
    if explicit is not None or precision not in _MIXED:
        return explicit
    return MixedPrecisionPolicy(param_dtype=_MIXED[precision], reduce_dtype=torch.float32)


def parallelize_default(module: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig, zoo: ParallelizeOptions,
                        options: AutoOptions) -> nn.Module:
    """Every zoo model in ``module`` (``module`` itself included) by its kind's ``parallelize_fn`` with ``zoo``; a
    module that holds none by `parallelize_auto` with ``options``."""
    decoders = [m for m in module.modules() if isinstance(m, Decoder)]
    if not decoders:
        return parallelize_auto(module, mesh, pcfg, options)
    for decoder in decoders:
        spec_for(decoder.config).parallelize_fn(decoder, mesh, pcfg, zoo)
    return module


def parallelize_auto(module: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig, options: AutoOptions) -> nn.Module:
    """TP from the plan when ``pcfg.tp > 1``, then FSDP2 per block and per root (see the module docstring)."""
    if pcfg.pp > 1 or pcfg.ep > 1:
        raise ValueError(f"{pcfg.short()}: pipeline and expert parallelism need a model that splits itself; "
                         f"{type(module).__name__} has no configure_model(): use pp=1 and ep=1, or parallelise the "
                         "model in configure_model()")
    roots = _roots(module)
    tp_mesh, dp_mesh = dense_meshes(mesh, pcfg)
    tied = tied_groups(module)
    if tp_mesh.size() > 1:
        plan = options.tp_plan if options.tp_plan is not None else _carried_plan(roots)
        if not plan:
            raise ValueError(
                f"tp={pcfg.tp} needs a tensor-parallel plan, and {type(module).__name__} has no configure_model() "
                "and its model carries none (a Hugging Face model's _tp_plan): give "
                "DynaTrainStrategy(parallelism={'tp_plan': {'model.layers.*.q_proj': 'colwise', ...}}) or use tp=1")
        apply_plan(module, tp_mesh, plan)
        retie(module, tied)
    kwargs = {"mesh": dp_mesh} if options.mp_policy is None else {"mesh": dp_mesh, "mp_policy": options.mp_policy}
    shared = {id(module.get_parameter(n)) for group in tied for n in group[:1]}
    for _, root in roots:
        blocks = [b for b in find_blocks(root, options.block_types) if not _splits_a_tie(root, b, shared)]
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again at once by backward: keep them gathered.
            fully_shard(block, reshard_after_forward=options.reshard_after_forward and i < len(blocks) - 1, **kwargs)
        fully_shard(root, reshard_after_forward=options.reshard_after_forward, **kwargs)
    return module


def _roots(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The LightningModule's parameter-holding children (fully_shard on the LightningModule itself would leave a
    switch nothing to replace)."""
    own = [n for n, p in module._parameters.items() if p is not None]
    if own:
        raise ValueError(f"{type(module).__name__} holds parameters itself ({', '.join(own)}): the default "
                         "parallelisation shards the modules it holds; move them into a child module")
    return [(n, c) for n, c in module.named_children() if next(c.parameters(), None) is not None]


def _carried_plan(roots: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """The plans the roots carry, keyed from the LightningModule."""
    plan: dict[str, str] = {}
    for name, root in roots:
        for key, style in (model_plan(root) or {}).items():
            plan[f"{name}.{key}"] = style
    return plan


def block_names(root: nn.Module, block_types: Sequence = ()) -> set[str]:
    """The class names of ``root``'s blocks: ``block_types``, else its ``_no_split_modules``, else the element
    classes of its largest ModuleList (by parameters); empty when it has none."""
    if block_types:
        return {t if isinstance(t, str) else t.__name__ for t in block_types}
    names = set(getattr(root, "_no_split_modules", None) or ())
    if names:
        return names
    lists = [m for m in root.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return set()
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return {type(m).__name__ for m in largest}


def find_blocks(root: nn.Module, block_types: Sequence = ()) -> list[nn.Module]:
    """The outermost modules of ``root`` (not ``root`` itself) whose class is a block's, in module order."""
    names = block_names(root, block_types)
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in root.modules():
        if m is root or id(m) in inside:
            continue
        if type(m).__name__ in names and next(m.parameters(), None) is not None:
            found.append(m)
            inside.update(id(x) for x in m.modules())
    if block_types and not found:
        present = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(f"block_types {sorted(names)} match no module of {type(root).__name__}; its module classes "
                         f"are {present}")
    return found


def tied_groups(module: nn.Module) -> list[list[str]]:
    """The names of each tensor two or more parameter names share, the first as `named_parameters` gives it."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(module: nn.Module, groups: list[list[str]]) -> None:
    """Make each group one parameter again (the first name's) after TP split its users one by one; ValueError when
    the plan split them differently."""
    for first, *others in groups:
        keep = module.get_parameter(first)
        for name in others:
            other = module.get_parameter(name)
            if other is keep:
                continue
            if _placed(other) != _placed(keep):
                raise ValueError(f"parameters {first!r} and {name!r} are one tied tensor, but the tensor-parallel "
                                 f"plan splits them differently ({_placed(keep)} vs {_placed(other)}): give both "
                                 "the same split (e.g. embedding_rowwise and colwise_gather_output), or untie them")
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner)._parameters[attr] = keep


def _placed(p: torch.Tensor):
    return (tuple(p.placements), p.device_mesh) if isinstance(p, DTensor) else None


def _splits_a_tie(root: nn.Module, block: nn.Module, shared: set[int]) -> bool:
    """Whether ``block`` holds a tied tensor that a module outside it uses too."""
    inside = {id(p) for p in block.parameters()} & shared
    if not inside:
        return False
    block_modules = {id(m) for m in block.modules()}
    return any(id(p) in inside for m in root.modules() if id(m) not in block_modules
               for p in m._parameters.values() if p is not None)
