"""From an agreed request to a target layout: the planner's view of the job and the decision that is recorded.

An explicit layout is taken as it is; a device count (or, for a bare preemption, the current world minus the
leaving ranks) goes to the layout planner, which on the same device count switches only when it pays.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dynatrain.policy import Workload
from dynatrain.signals.agreement import MergedRequest
from dynatrain.vps.parallel_config import ParallelConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch

NEEDS_ELASTIC = "changing the device count needs the elastic device manager"


@dataclass
class Decision:
    """What the job did about one agreed request. ``action``: ``switch``, ``keep`` or ``reject``."""

    step: int
    action: str
    request: str
    source: str
    reason: str
    target: str | None = None
    leave: tuple[int, ...] = ()
    sources: tuple[str, ...] = ()
    signal_to_decision_s: float | None = None
    agreement_s: float | None = None
    report_index: int | None = None
    standby: int | None = None  # a scale-out: standby processes ready to be admitted when it was decided (rank 0)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """The target a merged request turns into, or why there is none (``target`` None)."""

    action: str
    target: ParallelConfig | None
    reason: str


def plan_target(merged: MergedRequest, current: ParallelConfig, world: int, *,
                planner: Callable[[int, tuple[int, ...]], Any], can_change_world: bool) -> Plan:
    """Turn the agreed request into a target layout (pure apart from ``planner``).

    ``planner(count, leave)`` returns a `LayoutDecision` for ``count`` devices (ValueError when it cannot
    plan). ``can_change_world``: the strategy can add or drop processes (its ``request_switch`` takes ``leave``).
    """
    leave = merged.leave
    if merged.layout is not None:
        target = ParallelConfig.parse(merged.layout)
        if target == current and not leave:
            return Plan("keep", None, f"already on {current.short()}")
        reason = f"layout {target.short()} requested"
    else:
        count = merged.devices if merged.devices is not None else world - len(leave)
        if count < 1:
            raise ValueError(f"ranks {','.join(map(str, leave))} leave and no process would be left")
        decision = planner(count, leave)
        target = decision.target
        if not decision.changes and not leave:
            return Plan("keep", None, decision.reason)
        reason = f"planner, {count} device(s): {decision.reason}"
    if (target.world_size != world or leave) and not can_change_world:
        raise ValueError(f"{NEEDS_ELASTIC}: {merged.describe()} asks to run on {target.world_size} of "
                         f"{world} processes")
    return Plan("switch", target, reason)


@dataclass(frozen=True)
class Unpriced:
    """The layout for a device count when the policy cannot price the job (a model of the user's own, data without
    a sequence length): the current layout on the same count, else the fallback of survivors of a lost process
    (``ParallelConfig.survivor_layouts``: the same tp degree where it divides the count, else pure FSDP)."""

    current: ParallelConfig
    count: int
    why: str

    @property
    def target(self) -> ParallelConfig:
        if self.count == self.current.world_size:
            return self.current
        return self.current.survivor_layouts(self.count)[0]

    @property
    def changes(self) -> bool:
        return self.target != self.current

    @property
    def reason(self) -> str:
        return f"not priced ({self.why}): {self.target.short()}"


def workload_for(trainer: pl.Trainer) -> Workload:
    """The planner's view of the job: the model, and sequence length and batch sizes from the data module."""
    strategy = trainer.strategy
    config = strategy.model_config() if hasattr(strategy, "model_config") else None
    if config is None:
        raise ValueError("the layout planner needs the model config: the LightningModule has no `model_config`")
    data = getattr(trainer, "datamodule", None)
    missing = [a for a in ("seq_len", "global_batch_size", "micro_batch_size") if not hasattr(data, a)]
    if missing:
        raise ValueError(f"the layout planner needs {', '.join(missing)} from the data module (a LlamaDataModule)")
    options = getattr(strategy, "parallelism", None)  # a DynaTrainStrategy's
    policy = getattr(options, "mp_policy", None)
    compute = _dtype_name(getattr(policy, "param_dtype", None)) or \
        ("bfloat16" if "bf16" in str(trainer.precision) else "float32")
    reduce = _dtype_name(getattr(policy, "reduce_dtype", None)) or "float32"
    # pp only for a module the strategy can run as a pipeline (docs/pipeline.md).
    pipeline = callable(getattr(getattr(trainer, "lightning_module", None), "pipeline_loss", None))
    return Workload(config, seq_len=data.seq_len, global_batch=data.global_batch_size,
                    micro_batch=data.micro_batch_size, compute_dtype=compute, reduce_dtype=reduce,
                    sequence_parallel=bool(getattr(options, "sequence_parallel", False)), pipeline=pipeline,
                    # The running job's policy: a switch keeps it, so the candidates are priced with it.
                    activation_checkpointing=str(getattr(options, "activation_checkpointing", None) or "none"),
                    loss_parallel=bool(getattr(options, "loss_parallel", False)))


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def accepts_leave(request_switch: Callable) -> bool:
    return accepts_keyword(request_switch, "leave")


def accepts_keyword(function: Callable, name: str) -> bool:
    """Whether ``function`` takes the keyword ``name`` (strategies written before an option was added do not)."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
