"""Candidate search: every layout of the devices at hand, each predicted (or excluded with its reasons), ranked by
predicted step time."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dynatrain.models.registry import ZooConfig, spec_for
from dynatrain.policy.comm import tp_spans_nodes
from dynatrain.policy.inputs import CHECKPOINTING_ORDER, GiB, CostModel, Devices, Workload
from dynatrain.policy.memory_model import MemoryEstimate, estimate_memory
from dynatrain.policy.sizes import pipeline_loads
from dynatrain.policy.step_model import StepTime, estimate_step
from dynatrain.vps.parallel_config import ParallelConfig


@dataclass(frozen=True)
class LayoutCandidate:
    """One layout on the devices at hand: its predictions, or why it cannot run (``reasons``)."""

    config: ParallelConfig
    reasons: tuple[str, ...] = ()
    time: StepTime | None = None
    memory: MemoryEstimate | None = None
    memory_limit: float = 0.0
    tokens_per_step: int = 0
    checkpointing: str = "none"  # the activation checkpointing the predictions assume

    @property
    def runnable(self) -> bool:
        return not self.reasons

    @property
    def excluded(self) -> str | None:
        return "; ".join(self.reasons) if self.reasons else None

    @property
    def step_seconds(self) -> float | None:
        return None if self.time is None else self.time.total

    @property
    def tokens_per_second(self) -> float | None:
        return None if self.time is None else self.tokens_per_step / self.time.total

    @property
    def memory_bytes(self) -> float | None:
        return None if self.memory is None else self.memory.total

    def describe(self) -> str:
        head = f"{self.config.short():<34}"
        if not self.runnable:
            return f"{head} excluded: {self.excluded}"
        ac = "" if self.checkpointing == "none" else f" checkpointing {self.checkpointing}"
        return (f"{head} {self.step_seconds:9.3f} s/step {self.tokens_per_second:12.0f} tokens/s "
                f"{self.memory_bytes / GiB:7.1f} GiB/device{ac}")


def _structural_reasons(cfg: ParallelConfig, devices: Devices, work: Workload) -> list[str]:
    reasons = []
    if cfg.world_size != devices.count:
        reasons.append(f"needs {cfg.world_size} devices, {devices.count} are at hand")
    if cfg.tp > 1 and tp_spans_nodes(cfg, devices.per_node):
        reasons.append(f"a TP group of {cfg.tp} would span nodes of {devices.per_node} devices: "
                       "tensor parallelism stays inside a node")
    per_step = cfg.dp_size * work.micro_batch
    if work.global_batch % per_step:
        reasons.append(
            f"global_batch={work.global_batch} is not a multiple of dp_size*micro_batch = "
            f"{cfg.dp_size}*{work.micro_batch} = {per_step}: gradient accumulation cannot keep the global batch"
        )
    if cfg.pp > 1 and work.global_batch // per_step < cfg.pp:
        reasons.append(
            f"1F1B needs at least pp={cfg.pp} micro-batches per step, and global_batch / (dp_size*micro_batch) = "
            f"{work.global_batch // per_step}: use a smaller pp or dp_size, or a larger global_batch"
        )
    return reasons


def _memory_reason(memory: MemoryEstimate, limit: float, devices: Devices, cost: CostModel) -> str:
    return (f"does not fit memory: needs {memory.total / GiB:.1f} GiB per device ({memory.describe()} GiB), "
            f"{limit / GiB:.1f} GiB usable ({devices.memory_bytes / GiB:.1f} GiB less the "
            f"{cost.reserve_fraction:.0%} reserve)")


def estimate_layout(cfg: ParallelConfig | str, devices: Devices, work: Workload,
                    cost: CostModel = CostModel()) -> LayoutCandidate:
    """Predictions for one layout, or the reasons it cannot run on ``devices``."""
    cfg = ParallelConfig.parse(cfg)
    limit = devices.memory_bytes * (1 - cost.reserve_fraction)
    base = dict(config=cfg, memory_limit=limit, tokens_per_step=work.tokens_per_step)
    try:
        cfg.validate(work.model)
        if cfg.pp > 1:
            pipeline_loads(work.model, cfg.pp)
    except ValueError as err:
        return LayoutCandidate(reasons=(str(err),), **base)
    reasons = _structural_reasons(cfg, devices, work)
    work, memory = _checkpointing_that_fits(cfg, work, limit)
    if memory.total > limit:
        reason = _memory_reason(memory, limit, devices, cost)
        reasons.append(reason + (" even with full activation checkpointing"
                                 if work.activation_checkpointing == "full" else ""))
    time = None
    if cfg.world_size == devices.count and not work.global_batch % (cfg.dp_size * work.micro_batch):
        time = estimate_step(cfg, devices, work, cost, work.global_batch // (cfg.dp_size * work.micro_batch))
    return LayoutCandidate(reasons=tuple(reasons), time=time, memory=memory,
                           checkpointing=work.activation_checkpointing, **base)


def _checkpointing_that_fits(cfg: ParallelConfig, work: Workload, limit: float) -> tuple[Workload, MemoryEstimate]:
    """The workload with its checkpointing resolved, and its memory: under ``auto`` the first policy of
    `CHECKPOINTING_ORDER` (least recompute first) whose memory fits ``limit``, else the last."""
    if work.activation_checkpointing != "auto":
        return work, estimate_memory(cfg, work)
    for policy in CHECKPOINTING_ORDER:
        resolved = work.with_checkpointing(policy)
        memory = estimate_memory(cfg, resolved)
        if memory.total <= limit:
            break
    return resolved, memory


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_configs(count: int, model: ZooConfig | None = None, pipeline: bool = True) -> list[ParallelConfig]:
    """Every (dp_replicate, dp_shard, tp) whose product is ``count``; for a ``model`` with routed experts also
    every ep that divides both dp_shard and the model's experts; for a ``model`` that splits into pipeline stages
    also every pp > 1 that divides ``count`` and has a layer per stage, with every (dp_replicate, dp_shard, tp) of
    ``count / pp`` (and every ep of it, as above)."""
    spec = None if model is None else spec_for(model)
    n_experts = model.n_experts if spec is not None and spec.routed_experts else None

    def stage_layouts(ranks: int, pp: int) -> list[ParallelConfig]:
        out = []
        for tp in _divisors(ranks):
            for shard in _divisors(ranks // tp):
                eps = [e for e in _divisors(shard) if n_experts and not n_experts % e] or [1]
                out += [ParallelConfig(ranks // (tp * shard), shard, tp, ep, pp) for ep in eps]
        return out

    out = stage_layouts(count, 1)
    if spec is not None and spec.pipeline and pipeline:
        for pp in _divisors(count)[1:]:
            if pp > model.n_layers:
                break
            out += stage_layouts(count // pp, pp)
    return out


def rank_key(c: LayoutCandidate) -> tuple:
    # Equal predicted times (compute-bound layouts) go to the smaller memory footprint, then the simpler mesh.
    return (float(f"{c.step_seconds:.9g}"), c.memory_bytes, c.config.tp, c.config.dp_replicate, c.config.ep,
            c.config.pp)


def rank_layouts(devices: Devices, work: Workload, cost: CostModel = CostModel()) -> list[LayoutCandidate]:
    """Every layout of ``devices.count`` devices: runnable ones fastest first, then the excluded ones."""
    cands = [estimate_layout(cfg, devices, work, cost)
             for cfg in enumerate_configs(devices.count, work.model, work.pipeline)]
    runnable = sorted((c for c in cands if c.runnable), key=rank_key)
    return runnable + [c for c in cands if not c.runnable]


def no_fit_message(devices: Devices, work: Workload, ranked: Iterable[LayoutCandidate]) -> str:
    lines = [
        f"no layout of model {work.model.name!r} runs on {devices.count} devices of "
        f"{devices.memory_bytes / GiB:.1f} GiB ({devices.per_node} per node) with seq_len={work.seq_len}, "
        f"global_batch={work.global_batch}, micro_batch={work.micro_batch}:"
    ]
    lines += [f"  {c.config.short()}: {c.excluded}" for c in ranked]
    return "\n".join(lines)


def choose_layout(devices: Devices, work: Workload, cost: CostModel = CostModel()) -> LayoutCandidate:
    """The runnable layout with the shortest predicted step; ValueError listing every exclusion if none runs."""
    ranked = rank_layouts(devices, work, cost)
    if not ranked[0].runnable:
        raise ValueError(no_fit_message(devices, work, ranked))
    return ranked[0]
