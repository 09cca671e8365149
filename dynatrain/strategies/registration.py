"""``strategy="dynatrain"`` for Lightning, registered without importing Lightning first.

Lightning looks strategies up by name in its `StrategyRegistry`, and it re-runs the user's script in every extra
process, so registration must happen whenever ``import dynatrain`` and Lightning meet in one process. Importing
Lightning costs seconds, and the pure layers (``dynatrain.vps``, ``dynatrain.planner``, ``dynatrain plan``) never
need it: so ``import dynatrain`` registers at once when Lightning is already loaded, and otherwise the moment
``lightning.pytorch`` finishes loading.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "lightning.pytorch"


def register() -> None:
    import dynatrain.strategies.dynatrain  # noqa: F401  (the strategy's module registers it when it loads)


def _loaded(name: str) -> bool:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``lightning.pytorch`` so `register` runs once that package is fully loaded.

    This hook is the registration itself, kept on purpose: it only makes ``strategy="dynatrain"`` known when
    Lightning loads after dynatrain. It answers for no other module, removes itself from ``sys.meta_path`` the first
    time ``lightning.pytorch`` is looked up, and changes nothing else (no ``gc.freeze``, no environment)."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            if "dynatrain.strategies.dynatrain" not in sys.modules:  # that module registers itself when loaded
                register()

        spec.loader.exec_module = exec_module
        return spec


def register_when_lightning_loads() -> None:
    if _loaded(_TARGET):
        if "dynatrain.strategies.dynatrain" not in sys.modules or _loaded("dynatrain.strategies.dynatrain"):
            register()
        return
    if not any(isinstance(f, _AfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightning())
