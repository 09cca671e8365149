"""Puts every Python process a test starts under the NCCL rules (`tests/nccl_rules.py`).

`tests/conftest.py` adds this directory to ``PYTHONPATH`` and sets ``$DYNATRAIN_NCCL_RULES``; Python imports
``sitecustomize`` at start-up, so the test launchers, Lightning's and the job launcher's processes alike get the
rules without a line in dynatrain. Importing torch here would add its start-up to processes that never use it:
the rules are installed when ``torch.distributed`` finishes importing instead.
"""

import importlib.abc
import importlib.machinery
import os
import sys


def _load_rules():
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, tests)
    try:
        import nccl_rules
    finally:
        sys.path.remove(tests)
    return nccl_rules


class _AfterTorchDistributed(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _load_rules().install()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("DYNATRAIN_NCCL_RULES"):
    sys.meta_path.insert(0, _AfterTorchDistributed())
