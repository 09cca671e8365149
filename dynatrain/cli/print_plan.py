"""``dynatrain fit --config RECIPE --print-plan``: what the layout policy predicts for a recipe (memory per device,
step time, tokens/s, and the policy's own best layout on the same devices), printed before any process starts.

The devices are the recipe's ``num_nodes x devices``; their memory and speed are not in a recipe, so they are
options: ``--plan.memory_gb`` (default 80, decimal GB as GPU makers count), ``--plan.tflops`` (peak in the compute
dtype, default 989: an H100/H200 in bf16) and ``--plan.mfu`` (the fraction of it training reaches, default 0.4).
The figures come from `dynatrain.policy` (docs/layouts.md), the same model the elastic callback decides with.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynatrain.models.specs import get_zoo_config
from dynatrain.policy import Devices, GiB, Workload, choose_layout, estimate_layout
from dynatrain.policy.search import LayoutCandidate
from dynatrain.vps.parallel_config import ParallelConfig

STRATEGY_CLASS = "dynatrain.DynaTrainStrategy"
# The memory model's error goal against measurement (bench/memory_model.py): a recipe fits with margin when its
# prediction plus this share still fits the usable memory.
MODEL_ERROR = 0.15


@dataclass(frozen=True)
class DeviceSpec:
    memory_gb: float = 80.0
    tflops: float = 989.0
    mfu: float = 0.4

    def devices(self, count: int, per_node: int) -> Devices:
        return Devices(count, int(self.memory_gb * 10**9), per_node=per_node, flops=self.tflops * 1e12,
                       efficiency=self.mfu)

    def describe(self) -> str:
        return f"{self.memory_gb:g} GB, {self.tflops:g} TFLOP/s at {self.mfu:.0%}"


@dataclass(frozen=True)
class RecipePlan:
    """The recipe's layout as the policy predicts it, and the policy's best layout on the same devices (checkpointing
    ``auto``), or why there is none (``best_error``)."""

    model: str
    nodes: int
    per_node: int
    spec: DeviceSpec
    work: Workload
    layout: LayoutCandidate
    best: LayoutCandidate | None
    best_error: str | None

    @property
    def fits(self) -> bool:
        return self.layout.runnable

    @property
    def fits_with_margin(self) -> bool:
        c = self.layout
        return c.runnable and c.memory.total * (1 + MODEL_ERROR) <= c.memory_limit

    def headline(self) -> str:
        """One line a recipe states in its header, checked against this prediction by the tests."""
        c = self.layout
        if c.time is None or c.memory is None:
            return f"# --print-plan ({self.spec.describe()}): {c.config.short()} cannot run"
        return (f"# --print-plan ({self.spec.describe()}): {c.memory.total / GiB:.1f} GiB/device of "
                f"{c.memory_limit / GiB:.1f} usable, {c.step_seconds:.2f} s/step, {c.tokens_per_second:,.0f} tokens/s")


def _get(node, key, default=None):
    value = node.get(key, default) if isinstance(node, dict) else getattr(node, key, default)
    return default if value is None else value


def _count(value, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str) and value.isdigit() and int(value) >= 1:
        return int(value)
    raise ValueError(f"--print-plan needs a device count: trainer.{what} is {value!r}; set it, e.g. "
                     f"--trainer.{what} 8")


def plan_recipe(config, spec: DeviceSpec = DeviceSpec()) -> RecipePlan:
    """Predict a recipe from its parsed `dynatrain fit` config (the ``fit`` namespace of the CLI, or the same keys as
    nested dicts): the strategy's layout and options, the model's name and overrides, the data's batch shape."""
    trainer, model, data = _get(config, "trainer", {}), _get(config, "model", {}), _get(config, "data", {})
    strategy = _get(trainer, "strategy", "dynatrain")
    if isinstance(strategy, str):
        if strategy != "dynatrain":
            raise ValueError(f"--print-plan predicts dynatrain's layouts; trainer.strategy is {strategy!r}")
        options = {}
    else:
        if _get(strategy, "class_path") not in (STRATEGY_CLASS, "dynatrain.strategies.DynaTrainStrategy",
                                                "dynatrain.strategies.dynatrain.DynaTrainStrategy"):
            raise ValueError(f"--print-plan predicts dynatrain's layouts; trainer.strategy is "
                             f"{_get(strategy, 'class_path')!r}")
        options = _get(strategy, "init_args", {})
    per_node = _count(_get(trainer, "devices", 1), "devices")
    nodes = _count(_get(trainer, "num_nodes", 1), "num_nodes")
    name = _get(model, "model", "debug")
    overrides = dict(_get(model, "model_overrides", {}) or {})
    model_config = get_zoo_config(name).with_overrides(**overrides)
    precision = str(_get(trainer, "precision", "32-true"))
    par = _get(options, "parallelism", {})
    compute = _get(par, "param_dtype", "bfloat16" if "bf16" in precision else "float32")
    ac = _get(par, "activation_checkpointing", "none")
    work = Workload(model_config, seq_len=int(_get(data, "seq_len", 128)),
                    global_batch=int(_get(data, "global_batch_size", 16)),
                    micro_batch=int(_get(data, "micro_batch_size", 4)), compute_dtype=str(compute),
                    reduce_dtype=str(_get(par, "reduce_dtype", "float32")),
                    sequence_parallel=bool(_get(par, "sequence_parallel", False)),
                    activation_checkpointing=str(ac), loss_parallel=bool(_get(par, "loss_parallel", True)))
    devices = spec.devices(nodes * per_node, per_node)
    request = _get(options, "parallel", "auto")
    layout = ParallelConfig(dp_shard=devices.count) if request == "auto" else ParallelConfig.parse(str(request))
    try:
        best, best_error = choose_layout(devices, work.with_checkpointing("auto")), None
    except ValueError as err:
        best, best_error = None, str(err)
    return RecipePlan(model_config.name, nodes, per_node, spec, work, estimate_layout(layout, devices, work), best,
                      best_error)


def format_plan(plan: RecipePlan) -> str:
    work, c = plan.work, plan.layout
    lines = [
        f"{plan.model} on {plan.nodes * plan.per_node} devices ({plan.nodes} node(s) x {plan.per_node}; "
        f"{plan.spec.describe()}), seq_len {work.seq_len}, {work.global_batch} sequences/step, micro-batch "
        f"{work.micro_batch}, {work.compute_dtype} compute"
        + (", sequence parallel" if work.sequence_parallel else ""),
        f"recipe's layout   {c.config.short()}, activation checkpointing {c.checkpointing}",
    ]
    if c.memory is not None:
        spare = c.memory_limit - c.memory.total
        verdict = (f"fits, {spare / GiB:.1f} GiB spare" if plan.fits_with_margin else
                   f"fits by {spare / GiB:.1f} GiB, less than the memory model's {MODEL_ERROR:.0%} error: may run "
                   "out of memory" if spare >= 0 else f"DOES NOT FIT by {-spare / GiB:.1f} GiB")
        lines.append(f"  memory/device   {c.memory.total / GiB:.1f} GiB of {c.memory_limit / GiB:.1f} usable "
                     f"({c.memory.describe()} GiB): {verdict}")
    if c.time is not None:
        t = c.time
        lines.append(f"  step            {t.total:.3f} s, {c.tokens_per_second:,.0f} tokens/s (compute {t.compute:.3f}"
                     f" of which recompute {t.recompute:.3f}, tp {t.tp:.3f}, ep {t.ep:.3f}, cp {t.cp:.3f}, fsdp {t.fsdp:.3f}, "
                     f"hsdp "
                     f"{t.hsdp:.3f}, hidden -{t.hidden:.3f}, bubble {t.bubble:.3f}, p2p {t.p2p:.3f})")
    for reason in c.reasons:
        lines.append(f"  cannot run: {reason}")
    if plan.best is not None:
        lines.append(f"policy's best     {plan.best.describe().strip()}"
                     + ("" if plan.best.checkpointing != "none" else " (no checkpointing)"))
    else:
        lines.append(f"policy's best     none runs: {plan.best_error}")
    lines.append(f"recipe header     {plan.headline()}")
    return "\n".join(lines)
