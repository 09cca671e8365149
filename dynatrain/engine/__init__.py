"""The transition engine: runs a `SwitchPlan` on a process group (the only layer that moves bytes)."""

from dynatrain.engine.checks import (
    TransitionError,
    expected_destinations,
    expected_sources,
    torch_dtype,
    validate_sources,
)
from dynatrain.engine.stats import TransitionStats
from dynatrain.engine.transition import allocate_destinations, run_transition

__all__ = [
    "TransitionError",
    "TransitionStats",
    "allocate_destinations",
    "expected_destinations",
    "expected_sources",
    "run_transition",
    "torch_dtype",
    "validate_sources",
]
