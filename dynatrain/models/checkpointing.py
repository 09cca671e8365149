"""Activation checkpointing of a model's transformer blocks: none, full, or selective (every n-th block, or per op).

A checkpointed block keeps only its inputs from the forward and runs its forward again in the backward
(`torch.utils.checkpoint`, non-reentrant), as torchtitan's ``apply_ac`` does. Unlike torchtitan, no wrapper module is
inserted: the block's ``forward`` is replaced on the instance. `checkpoint_wrapper` would put
``_checkpoint_wrapped_module`` into every parameter name of a checkpointed block, and parameters are addressed by
name everywhere here: a switch captures and plans states by name, snapshots store them by name, and the zoo seeds
each parameter's initial value by its name. A job with checkpointing and one without (or with another every-n) would
then disagree about names, and checkpointing would change the initial weights. With the forward replaced on the
instance, names and state dict keys are those of the plain model, whatever the policy.

The recomputation gives the forward's values: the zoo's blocks hold no dropout, and the RNG state is restored for
it anyway (``preserve_rng_state``). A block's forward may change its modules' state (a MoE router counts the tokens
each expert received and keeps its last auxiliary loss); the eager recomputation undoes such changes, so the routers
count each token once. Under `torch.compile` the compiled backward recomputes without running Python (see
`models.compile`).

Selective per op keeps, within a checkpointed block, the outputs of attention, of collectives (no communication is
redone in the backward) and of every other matmul (the 1st, 3rd, ... of the block's forward), and recomputes the rest:
about half a block's activation memory for a fraction of its recompute (torchtitan's ``selective`` op policy, with
this simpler rule).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class ActivationCheckpointing:
    """Which blocks recompute their forward in the backward: ``none``; ``full`` (every block); ``selective`` every
    ``every``-th block (blocks ``every-1, 2*every-1, ...`` of the whole model, counted by their index in ``layers``
    so a pipeline stage or a switch picks the same ones), or, with ``per_op``, every block with the op policy above."""

    mode: str = "none"
    every: int = 1
    per_op: bool = False

    @classmethod
    def parse(cls, value: "str | bool | None | ActivationCheckpointing") -> "ActivationCheckpointing":
        """``"none"`` (or None / False), ``"full"`` (or True), ``"selective"`` / ``"selective:op"`` (per op) or
        ``"selective:N"`` (every N-th block)."""
        if isinstance(value, ActivationCheckpointing):
            return value
        if value is None or value is False:
            return cls()
        if value is True:
            return cls("full")
        text = str(value).strip().lower()
        mode, _, option = text.partition(":")
        if mode in ("none", "full") and not option:
            return cls(mode)
        if mode == "selective":
            if option in ("", "op"):
                return cls("selective", per_op=True)
            if option.isdigit() and int(option) >= 1:
                return cls("selective", every=int(option))
        raise ValueError(f"activation_checkpointing={value!r}: use 'none', 'full', 'selective:op' (per op) or "
                         "'selective:N' (every N-th block, N >= 1)")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def checkpoints(self, index: int) -> bool:
        """Whether the block at layer index ``index`` (of the whole model) is checkpointed."""
        if self.mode == "full" or (self.mode == "selective" and self.per_op):
            return True
        return self.mode == "selective" and (index + 1) % self.every == 0

    def __str__(self) -> str:
        if self.mode != "selective":
            return self.mode
        return "selective:op" if self.per_op else f"selective:{self.every}"


def apply_ac(model: nn.Module, policy: "ActivationCheckpointing | str | None") -> list[str]:
    """Checkpoint the blocks of ``model.layers`` that ``policy`` names (after TP, before compile and FSDP, as in
    torchtitan; since no module is wrapped, the order to FSDP does not matter). Returns their keys. Applying it again
    to a checkpointed block changes nothing."""
    policy = ActivationCheckpointing.parse(policy)
    if not policy.enabled:
        return []
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(f"activation checkpointing needs the model's blocks in an nn.ModuleDict called `layers`; "
                         f"{type(model).__name__} has none: checkpoint your own blocks with "
                         "dynatrain.models.checkpointing.checkpoint_block")
    done = []
    for position, (key, block) in enumerate(layers.items()):
        index = int(key) if key.isdigit() else position
        if policy.checkpoints(index):
            checkpoint_block(block, per_op=policy.per_op)
            done.append(key)
    return done


def checkpoint_block(block: nn.Module, per_op: bool = False) -> None:
    """Make ``block`` recompute its forward in the backward (per op: keep the outputs the op policy saves)."""
    if isinstance(block.__dict__.get("forward"), _CheckpointedForward):
        return
    block.forward = _CheckpointedForward(block, block.forward, per_op)


def is_checkpointed(block: nn.Module) -> bool:
    return isinstance(block.__dict__.get("forward"), _CheckpointedForward)


class _CheckpointedForward:
    """The block's forward under `torch.utils.checkpoint` (an attribute of the block instance, not a module)."""

    def __init__(self, block: nn.Module, inner, per_op: bool) -> None:
        self.block, self.inner, self.per_op = block, inner, per_op

    def __call__(self, *args, **kwargs):
        if self.per_op:
            return checkpoint(self._run, *args, use_reentrant=False, context_fn=_op_policy_contexts, **kwargs)
        return checkpoint(self._run, *args, use_reentrant=False, **kwargs)

    def _run(self, *args, **kwargs):
        # The eager recomputation runs inside the backward; the first run is the forward.
        if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
            return self.inner(*args, **kwargs)
        with _state_kept(self.block):
            return self.inner(*args, **kwargs)


@contextmanager
def _state_kept(module: nn.Module):
    """Undo what a run of ``module``'s forward changes in its modules: buffers (values) and tensor attributes."""
    # Outside the recomputation's dispatch modes: the per-op policy's mode would take these copies for the block's ops.
    with _disable_current_modes():
        buffers = [(m, name, b, b.detach().clone()) for m in module.modules() for name, b in m._buffers.items()
                   if b is not None]
    attributes = [(m, k, v) for m in module.modules() for k, v in vars(m).items() if isinstance(v, torch.Tensor)]
    try:
        yield
    finally:
        with _disable_current_modes(), torch.no_grad():
            for m, name, buffer, value in buffers:
                m._buffers[name] = buffer
                buffer.copy_(value)
        for m, k, v in attributes:
            m.__dict__[k] = v


def _ops(*names: str) -> frozenset:
    """The ops of ``names`` (``namespace.op.overload``) this torch has."""
    found = []
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return frozenset(found)


_MATMULS = _ops("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._grouped_mm.default")
_SAVED = _ops(
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_reduce.default",
    "_c10d_functional.all_to_all_single.default",
)


def _op_policy_contexts():
    # One count per checkpointed call, kept apart for the forward and the recomputation, which must agree on
    # which matmuls were saved.
    matmuls = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in _MATMULS:
            matmuls[ctx.is_recompute] += 1
            save = matmuls[ctx.is_recompute] % 2 == 1
        else:
            save = func in _SAVED
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
