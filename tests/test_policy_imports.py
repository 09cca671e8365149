"""The layout policy and the routing planner are pure layers: importing them loads neither Lightning nor torch, and
the planner never imports the policy that sits above it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dynatrain"
HEAVY = ("lightning", "lightning_fabric", "pytorch_lightning", "torch")


def _heavy_modules_after(code: str) -> list[str]:
    probe = (f"{code}\nimport sys\n"
             f"print('\\n'.join(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


@pytest.mark.timeout(120)
def test_policy_and_planner_import_without_lightning_or_torch():
    assert _heavy_modules_after("import dynatrain.policy, dynatrain.planner") == []


@pytest.mark.timeout(120)
def test_policy_decides_without_lightning_or_torch():
    code = ("from dynatrain.policy import GiB, Devices, Workload, plan_layout\n"
            "d = plan_layout(Devices(8, 80 * GiB, per_node=8, flops=989e12),\n"
            "                Workload('debug', seq_len=256, global_batch=32), current='dp_shard=4,tp=2')\n"
            "assert d.target.world_size == 8")
    assert _heavy_modules_after(code) == []


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_planner_never_imports_the_policy_above_it():
    files = sorted((PACKAGE / "planner").rglob("*.py"))
    assert files
    upward = {str(f.relative_to(PACKAGE)): sorted(m for m in _imported_modules(f) if m.startswith("dynatrain.policy"))
              for f in files}
    assert {f: m for f, m in upward.items() if m} == {}
