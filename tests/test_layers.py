"""The layers depend downward only: no import cycle between dynatrain's modules, the pure layers import neither
models nor Lightning nor a process group, and strategies never import callbacks."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "dynatrain"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str] = frozenset()) -> set[str]:
    """Every import of the module, wherever it sits: at the top, inside a function, or under ``if TYPE_CHECKING:``
    (a deferred or type-only import is still a dependency of the design, and a circle it closes is still a circle).
    ``from package import module`` depends on the module, not on the package's ``__init__``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named = {f"{node.module}.{a.name}" for a in node.names}
            out |= named if named <= set(modules) else named | {node.module}
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {name: {m for m in _imports(path, set(modules)) if m in modules and m != name}
            for name, path in modules.items()}


def test_no_import_cycle_between_modules():
    """Function-level and type-only imports count: they are dependencies of the design as much as the others."""
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_pure_layers_import_no_models_lightning_or_process_group():
    for layer in ("vps", "planner"):
        for path in (PKG / layer).rglob("*.py"):
            bad = [m for m in _imports(path)
                   if m.startswith(("dynatrain.models", "lightning", "torch"))]
            assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}"


def test_strategies_never_import_callbacks():
    for path in (PKG / "strategies").rglob("*.py"):
        bad = [m for m in _imports(path) if m.startswith("dynatrain.callbacks")]
        assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}"


# The layers of docs/architecture.md, lowest first: a module imports only from tiers below its own (or from its own
# package). Callbacks sit above the strategy: they talk to it, it never imports them.
TIERS = [
    {"settings"},
    {"runtime", "vps"},
    {"models", "planner", "data"},
    {"engine", "signals", "elastic"},
    {"policy", "lm", "check"},
    {"switch"},
    {"strategies"},
    {"callbacks"},
    {"launch"},
    {"selfcheck"},
    {"cli"},
]


def test_every_import_goes_down_the_layers():
    tier = {name: i for i, names in enumerate(TIERS) for name in names}
    graph = _graph()
    unplaced = sorted({m.split(".")[1] for m in graph if m.count(".") >= 1} - set(tier))
    assert not unplaced, f"place {unplaced} in TIERS"
    upward = []
    for module, targets in graph.items():
        if module == "dynatrain":
            continue  # the package root registers the strategy for Lightning users: it sits above every layer
        here = module.split(".")[1]
        for target in targets:
            if target == "dynatrain":
                continue  # `from dynatrain import engine` names a submodule, counted under its own name
            there = target.split(".")[1]
            if there != here and tier[there] >= tier[here]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not go down the layers: " + ", ".join(sorted(upward))


MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 80


def test_files_and_functions_stay_small():
    """A file is read whole and a function at one glance: past these a file holds two jobs and a function two steps."""
    big = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PKG.parent)
        if text.count("\n") > MAX_FILE_LINES:
            big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not big, f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function: " + ", ".join(big)
