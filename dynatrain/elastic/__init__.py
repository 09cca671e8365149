"""Elastic worlds: a store that outlives training processes, and numbered generations of process groups.

Nothing here imports Lightning, so a joining process pays only for torch until it builds its model. Names are
imported on first use so that ``python -m dynatrain.elastic.store`` does not import its own module twice.
"""

import importlib

_STORE = ("StoreProcess", "connect", "request_shutdown", "start_store")
_WORLD = (
    "RegistrationError", "StateMover", "WorldChange", "WorldGeneration", "announce", "await_admission", "config_hash",
    "deregister", "join", "pending_joiners", "plan_union_then_target", "register", "registered", "run_world_change",
    "set_job_info", "union_then_target",
)
__all__ = sorted(_STORE + _WORLD)


def __getattr__(name: str):
    if name in _STORE or name in _WORLD:
        module = importlib.import_module("dynatrain.elastic." + ("store" if name in _STORE else "world"))
        return getattr(module, name)
    raise AttributeError(f"module 'dynatrain.elastic' has no attribute {name!r}")
