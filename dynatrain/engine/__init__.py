"""The transition engine: runs a `SwitchPlan` on a process group (the only layer that moves bytes)."""

from dynatrain.engine.transition import (
    TransitionError,
    TransitionStats,
    expected_destinations,
    expected_sources,
    run_transition,
    torch_dtype,
    validate_sources,
)

__all__ = [
    "TransitionError",
    "TransitionStats",
    "expected_destinations",
    "expected_sources",
    "run_transition",
    "torch_dtype",
    "validate_sources",
]
