"""Elastic worlds: a store that outlives training processes, and numbered generations of process groups.

Nothing here imports Lightning, so a joining process pays only for torch until it builds its model. Names are
imported on first use so that ``python -m dynatrain.elastic.store`` does not import its own module twice.
"""

import importlib

_STORE = ("StoreProcess", "connect", "request_shutdown", "start_store")
_WORLD = (
    "StateMover", "WorldChange", "WorldGeneration", "announce", "await_admission", "join", "plan_union_then_target",
    "run_world_change", "union_then_target",
)
_REGISTRY = ("RegistrationError", "config_hash", "deregister", "pending_joiners", "register", "registered",
             "set_job_info")
_MODULES = {**{n: "store" for n in _STORE}, **{n: "world" for n in _WORLD}, **{n: "registry" for n in _REGISTRY}}
__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        module = importlib.import_module("dynatrain.elastic." + _MODULES[name])
        return getattr(module, name)
    raise AttributeError(f"module 'dynatrain.elastic' has no attribute {name!r}")
