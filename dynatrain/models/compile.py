"""`torch.compile` per transformer block, as torchtitan does: the blocks share one code object, so a layout
compiles once, not once per block (a block's parameters are graph inputs, not constants).

Each block is compiled in place (`nn.Module.compile`): no ``_orig_mod`` enters the parameter names, which a switch,
snapshots and the zoo's seeded initialisation read. Compilation is lazy, at the block's first call; a new layout
(other local shapes or placements of the weights) compiles again at its first step, and a layout compiled before in
this process is found in dynamo's cache. `compile_seconds` counts the seconds compilation took in this process
(forward, and backward compiled at its first run), which the strategy reports per switch.

Graph breaks are allowed (``fullgraph=False``): the MoE blocks route by data-dependent counts. Under activation
checkpointing the compiled backward recomputes inside the compiled graph, where a block's forward side effects are
not replayed (dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``), as eager checkpointing also undoes them
(`models.checkpointing`).
"""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

DEFAULT_BACKEND = "inductor"
# Every block shares the compiled frame; each layout visited and each checkpointing variant adds a cache entry.
_RECOMPILE_LIMIT = 64


def compile_backend(value: "bool | str | None") -> str | None:
    """The backend a strategy's ``compile`` option names: None (off: False, None, "none", "off", "false"),
    ``"inductor"`` (True, "true", "on"), or any backend `torch.compile` knows (``"aot_eager"`` skips code
    generation)."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_BACKEND
    text = str(value).strip().lower()
    if text in ("none", "off", "false", ""):
        return None
    if text in ("true", "on"):
        return DEFAULT_BACKEND
    known = torch._dynamo.list_backends(exclude_tags=())
    if text not in known:
        raise ValueError(f"compile={value!r}: use true (inductor), false, or a torch.compile backend: "
                         f"{', '.join(sorted(known))}")
    return text


def apply_compile(model: nn.Module, backend: str | None = DEFAULT_BACKEND) -> list[str]:
    """Compile each block of ``model.layers`` in place (after TP and activation checkpointing, before FSDP, as in
    torchtitan). Returns the compiled blocks' keys; None as the backend compiles nothing."""
    if backend is None:
        return []
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(f"compiling per block needs the model's blocks in an nn.ModuleDict called `layers`; "
                         f"{type(model).__name__} has none: compile your own blocks with `block.compile()`")
    _configure()
    for block in layers.values():
        block.compile(backend=backend, fullgraph=False)
    return list(layers.keys())


def is_compiled(block: nn.Module) -> bool:
    return getattr(block, "_compiled_call_impl", None) is not None


def compile_seconds() -> float:
    """Seconds `torch.compile` has spent compiling in this process since blocks were first compiled (one that is
    compiling now counts up to now)."""
    with _clock.lock:
        running = time.perf_counter() - _clock.started if _clock.started is not None else 0.0
        return _clock.total + running


class _Clock:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total = 0.0
        self.started: float | None = None
        self.installed = False

    def start(self, _args) -> None:
        with self.lock:
            self.started = time.perf_counter()

    def end(self, _args) -> None:
        with self.lock:
            if self.started is not None:
                self.total += time.perf_counter() - self.started
                self.started = None


_clock = _Clock()


def _configure() -> None:
    if _clock.installed:
        return
    from torch._dynamo.callback import callback_handler

    # Dynamo runs these around each outermost compilation (nested ones run inside it), lazy backward included.
    callback_handler.register_start_callback(_clock.start)
    callback_handler.register_end_callback(_clock.end)
    _clock.installed = True
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, _RECOMPILE_LIMIT)
    if hasattr(dynamo, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint = True
