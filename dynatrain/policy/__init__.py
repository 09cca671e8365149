"""Layout policy: which ``pp x dp_replicate x dp_shard x tp`` (and, for a mixture-of-experts model, which ``ep``) to
run on the devices at hand, and whether a switch to it pays for itself. Pipeline layouts are costed as 1F1B with one
stage per pp rank (the terms are in `dynatrain.planner.pipeline_cost`).

Pure Python (no torch, no process group): a 70B model on 1,024 devices is sized in milliseconds. The cost model, its
formulas and its assumptions are in docs/layouts.md; the switch cost comes from the routing planner (`plan_switch`)
and its network model. This layer sits above `dynatrain.planner`, which never imports it.

    devices = Devices(count=64, memory_bytes=80 * GiB, per_node=8, flops=989e12)
    work = Workload("llama3-70b", seq_len=4096, global_batch=256, micro_batch=1)
    best = choose_layout(devices, work)                       # LayoutCandidate, or ValueError listing why not
    decision = plan_layout(devices, work, current=ParallelConfig.parse("dp_shard=16,tp=4"))

Modules, by job: `inputs` (Devices, Workload, CostModel), `sizes` and `comm` (parameter counts, collective times),
`memory_model` and `step_model` (the per-layout predictions), `search` (enumerate and rank layouts),
`switch_cost` (price a switch with the routing planner), `decision` (LayoutPolicy: switch only when it pays).
"""

from dynatrain.policy.decision import LayoutDecision, LayoutPolicy, plan_layout
from dynatrain.policy.inputs import DEFAULT_SWITCH_BUDGET, GiB, CostModel, Devices, Workload
from dynatrain.policy.memory_model import MemoryEstimate, estimate_memory
from dynatrain.policy.search import (
    LayoutCandidate, choose_layout, enumerate_configs, estimate_layout, rank_layouts,
)
from dynatrain.policy.step_model import StepTime, estimate_step
from dynatrain.policy.switch_cost import SwitchCost, SwitchVerdict, price_switch, weigh_switch

__all__ = [
    "DEFAULT_SWITCH_BUDGET", "GiB", "CostModel", "Devices", "Workload",
    "MemoryEstimate", "StepTime", "LayoutCandidate", "SwitchCost", "SwitchVerdict", "LayoutDecision",
    "LayoutPolicy", "choose_layout", "enumerate_configs", "estimate_layout", "estimate_memory", "estimate_step",
    "plan_layout", "price_switch", "rank_layouts", "weigh_switch",
]
