"""The transition engine: runs a `SwitchPlan` on a process group, and moves bytes only (the only layer that does).

transition.py (`run_transition`, the engine's entry point: one rank's run, round by round; `allocate_destinations`),
rounds.py (one round's slots and timings, alike for the batched and the streamed way), wire.py (which pieces go on
the wire in place, which are packed, and where), local_copies.py (states kept in place, the order of local copies),
checks.py (what a rank hands in and gets back, checked before any byte moves), stats.py (`TransitionStats`, live
bytes), storages.py (a source's storage emptied after its last use, whoever else holds the tensor), device_memory.py
(the bound kept for a GPU's caching allocator), copy_threads.py (the copies' threads on a CPU). Whether the bytes
landed where their tensors say is not the engine's to judge: `dynatrain.check` does that.
"""

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
