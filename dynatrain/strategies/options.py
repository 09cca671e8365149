"""The option groups of `DynaTrainStrategy` beyond Lightning's own arguments: how a layout is parallelised
(``parallelism=``), how a layout switch runs (``switching=``) and what the data split checks (``data=``); the elastic
job's options are `dynatrain.elastic.manager.ElasticConfig` (``elastic=``).

Each option takes its dataclass or a plain dict of its fields, as a YAML recipe's ``strategy.init_args`` or
LightningCLI's ``--trainer.strategy.init_args.parallelism.sequence_parallel true`` give it; a key that is no field
is refused with the valid ones named. Values are checked when the option is made, so a bad one fails before any
process starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from dynatrain.models.checkpointing import ActivationCheckpointing
from dynatrain.models.compile import compile_backend
from dynatrain.models.parallelize import ParallelizeOptions
from dynatrain.strategies.pipeline_runner import check_schedule

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_RANK_MAPS = ("auto", "optimal", "identity")

T = TypeVar("T")


def _dtype(name: str | None, what: str) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"{what}={name!r} is not supported; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class ParallelismOptions:
    """How the default parallelisation (the zoo's, or `models.auto_parallel` for another module) builds a layout.

    Args:
        sequence_parallel: shard activations along the sequence between TP regions.
        param_dtype: FSDP2 mixed precision: dtype parameters are gathered in (``"bfloat16"``), or None; by default
            Lightning's ``precision`` decides (``"bf16-mixed"``: bf16 parameters, fp32 reduction).
        reduce_dtype: FSDP2 mixed precision: dtype of the gradient reduce-scatter (with ``param_dtype``).
        pipeline_schedule: with pp > 1, ``"1F1B"``, ``"GPipe"`` or ``"Interleaved1F1B"`` (several stages per rank).
        stages_per_rank: pipeline stages each pp rank runs (>= 2 with Interleaved1F1B, else 1).
        loss_parallel: with tp > 1 the logits stay split over the vocabulary, and a module that computes its loss
            under `torch.distributed.tensor.parallel.loss_parallel` (the zoo's `CausalLM` does) never gathers them
            whole; False gathers them on every rank.
        activation_checkpointing: ``"none"``, ``"full"`` (every block recomputes its forward in the backward),
            ``"selective:N"`` (every N-th block) or ``"selective:op"`` (every block keeps its attention, collective
            and every other matmul outputs); parameter names stay those of the plain model (see
            `dynatrain.models.checkpointing`).
        compile: `torch.compile` each transformer block: False, True (inductor) or a backend name (``"aot_eager"``).
            A switch's target blocks compile at its first step; `SwitchReport.compile_s` says how long that took.
        block_types: classes (or class names) whose modules the default parallelisation of a module without a zoo
            model shards as one FSDP2 unit each; by default a Hugging Face model's ``_no_split_modules``, else the
            element class of the largest ``nn.ModuleList``.
        tp_plan: for that parallelisation with tp > 1: module-name patterns (from the LightningModule, ``*`` for one
            name part) to ``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"``, ``"embedding_rowwise"``,
            ``"sequence_parallel"``; by default the plan a Hugging Face model carries (``_tp_plan``). A layout the
            plan cannot serve is refused when requested, with the reason.
        reshard_after_forward: that parallelisation frees gathered parameters after each block's forward (False
            keeps them until backward: more memory, fewer all-gathers).

    Checkpointing and compile apply to the default parallelisation; a ``parallelize_fn`` or a `configure_model()` of
    your own calls `dynatrain.models.checkpointing.apply_ac` and `dynatrain.models.compile.apply_compile` itself
    (between TP and FSDP) or reads them from the strategy's ``parallelism``.
    """

    sequence_parallel: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = "float32"
    pipeline_schedule: str = "1F1B"
    stages_per_rank: int = 1
    loss_parallel: bool = True
    activation_checkpointing: str = "none"
    compile: bool | str = False
    block_types: Sequence[type | str] = ()
    tp_plan: dict[str, str] | None = None
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        _dtype(self.param_dtype, "param_dtype")
        _dtype(self.reduce_dtype, "reduce_dtype")
        check_schedule(self.pipeline_schedule, self.stages_per_rank)
        # Kept in its canonical spelling: the planner prices the running job's policy by this string.
        object.__setattr__(self, "activation_checkpointing",
                           str(ActivationCheckpointing.parse(self.activation_checkpointing)))
        compile_backend(self.compile)
        object.__setattr__(self, "block_types", tuple(self.block_types))

    @property
    def mp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's mixed precision as given (None: Lightning's ``precision`` decides)."""
        param = _dtype(self.param_dtype, "param_dtype")
        if param is None:
            return None
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=_dtype(self.reduce_dtype, "reduce_dtype"))

    @property
    def checkpointing(self) -> ActivationCheckpointing:
        return ActivationCheckpointing.parse(self.activation_checkpointing)

    @property
    def compile_backend(self) -> str | None:
        """The `torch.compile` backend of ``compile``, None when off."""
        return compile_backend(self.compile)

    @property
    def parallelize_options(self) -> ParallelizeOptions:
        """The options a model kind's parallelisation reads (`ModelSpec.parallelize_fn`)."""
        return ParallelizeOptions(mp_policy=self.mp_policy, sequence_parallel=self.sequence_parallel,
                                  stages_per_rank=self.stages_per_rank, loss_parallel=self.loss_parallel,
                                  activation_checkpointing=self.checkpointing, compile_backend=self.compile_backend)


@dataclass(frozen=True)
class SwitchingOptions:
    """How a layout switch moves the state.

    Args:
        verify_switches: check every layout switch bitwise: each moved element hashed where it was sent and where it
            landed, indexed by its tensor's own placements, never by the plan; what stayed checked by its indices;
            optimizer scalars and LR schedulers hashed whole (see `dynatrain.check.verify`). Its seconds are the
            report's ``verify`` phase.
        switch_budget_mb: transient memory per rank for a layout switch beyond holding the state once: half stages a
            round's send + receive buffers, half holds the states in flight (see docs/planner.md).
        rank_map: how a switch places processes on the new mesh: ``"optimal"`` (fewest bytes on the wire),
            ``"identity"``, or ``"auto"``: the fewest bytes, except that a switch within the world keeps the default
            arrangement, whose target it built at the request, when the bytes that saves cost less wire time (as
            the job's switches measured it) than building the target again for another arrangement.
    """

    verify_switches: bool = True
    switch_budget_mb: float = 256.0
    rank_map: str = "auto"

    def __post_init__(self) -> None:
        if self.switch_budget_mb <= 0:
            raise ValueError(f"switch_budget_mb must be positive, got {self.switch_budget_mb}")
        if self.rank_map not in _RANK_MAPS:
            raise ValueError(f"rank_map={self.rank_map!r}: use 'auto', 'optimal' or 'identity'")

    @property
    def budget_bytes(self) -> int:
        return int(self.switch_budget_mb * 2**20)


@dataclass(frozen=True)
class DataOptions:
    """What the data split checks.

    Args:
        check_batches: the ranks of each data-parallel rank (a tp, pp or cp group) compare a fingerprint of every
            micro-batch and stop with the ranks and step when they differ; by default only the first micro-batch
            after each switch is compared.
    """

    check_batches: bool = False


def parse_option(cls: type[T], value: T | Mapping | None, name: str) -> T:
    """``value`` as a ``cls``: itself, a dict of its fields, or None for its defaults."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(valid))
        if unknown:
            raise ValueError(f"{name}: unknown option(s) {', '.join(map(repr, unknown))}; the valid ones are "
                             f"{', '.join(valid)}")
        return cls(**value)
    raise TypeError(f"{name}= takes a {cls.__name__} or a dict of its fields, got {value!r}")
