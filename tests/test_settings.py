"""Settings are arguments: every ``DYNATRAIN_*`` variable dynatrain reads is in `dynatrain.settings.SETTINGS` with the
argument that overrides it, an explicit argument wins over the environment, and ``import dynatrain`` changes nothing
in the interpreter beyond registering the strategy."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from dynatrain.settings import SETTINGS, explicit_or_env

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "dynatrain"
NAME = re.compile(r"DYNATRAIN_[A-Z0-9_]+")
READERS = ("get", "getenv", "setdefault", "pop")  # environ.get(K), os.getenv(K), env.get(K) of a child's mapping


def _sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _constants(trees: dict[str, ast.AST]) -> dict[str, set[str]]:
    """NAME -> the DYNATRAIN_* values assigned to it anywhere (``JOIN_ENV = "DYNATRAIN_JOIN"``); a name two modules
    give different values (TOKEN_ENV) maps to both."""
    out: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str) and NAME.fullmatch(node.value.value):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out.setdefault(target.id, set()).add(node.value.value)
    return out


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _key(node: ast.AST | None, constants: dict[str, set[str]]) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} if NAME.fullmatch(node.value) else set()
    if isinstance(node, ast.Name):
        return constants.get(node.id, set())
    if isinstance(node, ast.Attribute):
        return constants.get(node.attr, set())
    return set()


def env_reads(sources: dict[str, str]) -> list[tuple[str, int, str]]:
    """(file, line, variable) of every read of a DYNATRAIN_* variable: ``os.environ.get/[]/in``, ``os.getenv``,
    ``.get`` of an environment mapping (`memory.heap_env`'s) and `explicit_or_env`, the key a literal or a constant
    holding one."""
    trees = {path: ast.parse(text, path) for path, text in sources.items()}
    constants = _constants(trees)
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            key = None
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name == "explicit_or_env" and len(node.args) >= 2:
                    key = node.args[1]
                elif name in READERS and node.args:
                    key = node.args[0]  # of os.environ or an environment mapping: DYNATRAIN_ keys only
            elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
                key = node.slice
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) and \
                    _is_environ(node.comparators[0]):
                key = node.left
            for var in _key(key, constants):
                found.append((path, node.lineno, var))
    return found


def test_every_variable_dynatrain_reads_is_in_the_table_with_its_argument():
    reads = env_reads(_sources())
    missing = [f"{path}:{line}: {var}" for path, line, var in reads if var not in SETTINGS]
    assert not missing, ("DYNATRAIN_* variables read without an entry in dynatrain.settings.SETTINGS (add one naming "
                         "the argument that overrides it):\n" + "\n".join(missing))
    read = {var for _, _, var in reads}
    assert read >= {"DYNATRAIN_JOIN", "DYNATRAIN_ELASTIC", "DYNATRAIN_HEAP", "DYNATRAIN_CACHE"}, read  # it sees them
    assert not set(SETTINGS) - read, f"entries nothing reads any more: {sorted(set(SETTINGS) - read)}"


def test_every_dynatrain_variable_the_source_names_is_in_the_table():
    """Stricter than the reads: any string of the package (a value written for a child, a message) naming one."""
    named = {}
    for path, text in _sources().items():
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for var in NAME.findall(node.value):
                    named.setdefault(var, f"{path}:{node.lineno}")
    unknown = {var: where for var, where in named.items() if var not in SETTINGS}
    assert not unknown, f"DYNATRAIN_* variables named in the source but not in SETTINGS: {unknown}"


def test_a_new_variable_without_an_entry_is_caught():
    source = textwrap.dedent("""
        import os
        FOO_ENV = "DYNATRAIN_FOO"
        a = os.environ.get(FOO_ENV)
        b = os.getenv("DYNATRAIN_BAR")
        c = "DYNATRAIN_BAZ" in os.environ
        d = os.environ["DYNATRAIN_QUX"]
        e = explicit_or_env(None, "DYNATRAIN_QUUX")
        f = os.environ.get("HOME")
        g = env.get("DYNATRAIN_CORGE", "x")
    """)
    assert [var for _, _, var in env_reads({"x.py": source})] == [
        "DYNATRAIN_FOO", "DYNATRAIN_BAR", "DYNATRAIN_BAZ", "DYNATRAIN_QUX", "DYNATRAIN_QUUX", "DYNATRAIN_CORGE"]
    with pytest.raises(KeyError, match="DYNATRAIN_FOO is not in dynatrain.settings.SETTINGS"):
        explicit_or_env(None, "DYNATRAIN_FOO")


def _argument_exists(ref: str) -> bool:
    if " " in ref:  # "module --flag": a flag of the command that module implements
        module, flag = ref.split(" ")
        return f'"{flag}"' in Path(importlib.import_module(module).__file__).read_text()
    module, _, qualname = ref.partition(":")
    *owner, param = qualname.split(".")
    obj = importlib.import_module(module)
    for part in owner:
        obj = getattr(obj, part)
    if is_dataclass(obj) and param in {f.name for f in fields(obj)}:
        return True
    return param in inspect.signature(obj).parameters


def test_every_argument_the_table_names_exists():
    absent = [(s.env, ref) for s in SETTINGS.values() for ref in s.arguments if not _argument_exists(ref)]
    assert not absent, absent
    assert all(s.doc and s.arguments for s in SETTINGS.values())


def test_the_elastic_config_is_an_argument_and_the_launchers_json_only_its_default(monkeypatch):
    from dynatrain.elastic.manager import ElasticConfig
    from dynatrain.settings import ELASTIC_ENV

    monkeypatch.delenv(ELASTIC_ENV, raising=False)
    assert ElasticConfig.parse(None) is None  # not given, nothing carried: not elastic
    monkeypatch.setenv(ELASTIC_ENV, json.dumps({"max_devices": 3, "timeout": 7.0}))
    assert ElasticConfig.parse(None) == ElasticConfig(max_devices=3, timeout=7.0)  # what the launcher carried
    assert ElasticConfig.parse(False) is None  # an explicit value wins, False included
    assert ElasticConfig.parse({"timeout": 5.0}) == ElasticConfig(timeout=5.0)  # whole: max_devices is not merged in
    assert ElasticConfig.parse(True) == ElasticConfig()
    mine = ElasticConfig(max_devices=2)
    assert ElasticConfig.parse(mine) is mine


def test_join_rejoin_and_the_store_take_the_argument_before_the_environment(monkeypatch):
    from dynatrain.elastic.manager import ElasticConfig
    from dynatrain.settings import ENDPOINT_ENV, JOIN_ENV, REJOIN_ENV, TOKEN_ENV

    for var in (JOIN_ENV, REJOIN_ENV, ENDPOINT_ENV, TOKEN_ENV):
        monkeypatch.delenv(var, raising=False)
    plain = ElasticConfig().resolved()
    assert (plain.join, plain.rejoin, plain.endpoint, plain.token) == (False, False, None, None)
    assert ElasticConfig(join=True, rejoin=True).resolved().join is True
    monkeypatch.setenv(JOIN_ENV, "1")
    monkeypatch.setenv(REJOIN_ENV, "1")
    monkeypatch.setenv(ENDPOINT_ENV, "10.0.0.1:29400")
    monkeypatch.setenv(TOKEN_ENV, "carried")
    carried = ElasticConfig().resolved()  # a launcher's joiner
    assert (carried.join, carried.rejoin, carried.endpoint, carried.token) == (True, True, "10.0.0.1:29400", "carried")
    mine = ElasticConfig(join=False, rejoin=False, endpoint="127.0.0.1:1", token="mine").resolved()
    assert (mine.join, mine.rejoin, mine.endpoint, mine.token) == (False, False, "127.0.0.1:1", "mine")
    monkeypatch.setenv(JOIN_ENV, "0")
    assert ElasticConfig().resolved().join is False
    # A field in the launcher's JSON is an argument too: it wins over the separate variable.
    monkeypatch.setenv("DYNATRAIN_ELASTIC", json.dumps({"join": False}))
    monkeypatch.setenv(JOIN_ENV, "1")
    assert ElasticConfig.parse(None).resolved().join is False


def test_thread_split_heap_cache_freeze_and_verbosity_take_the_argument_first(monkeypatch, tmp_path):
    from dynatrain.cli.quiet import is_verbose
    from dynatrain.settings import VERBOSE_ENV
    from dynatrain.data.corpus import cache_dir
    from dynatrain.settings import CACHE_ENV
    from dynatrain.runtime.memory import TUNABLES_ENV, freeze_import_time_objects, heap_env
    from dynatrain.settings import FREEZE_ENV, HEAP_ENV
    from dynatrain.runtime.threads import SPLIT, splits_threads
    from dynatrain.settings import THREADS_ENV

    monkeypatch.setenv(THREADS_ENV, SPLIT)
    assert splits_threads() and not splits_threads(False)
    monkeypatch.delenv(THREADS_ENV)
    assert not splits_threads() and splits_threads(True)

    monkeypatch.delenv(TUNABLES_ENV, raising=False)
    assert heap_env({HEAP_ENV: "reuse"}, heap="glibc") == {HEAP_ENV: "glibc"}
    if sys.platform.startswith("linux"):
        ours = heap_env({HEAP_ENV: "glibc"}, heap="reuse")
        assert ours[HEAP_ENV] == "reuse" and TUNABLES_ENV in ours
    with pytest.raises(ValueError, match="heap='reus'"):
        heap_env({}, heap="reus")

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env" and cache_dir(tmp_path / "arg") == tmp_path / "arg"

    monkeypatch.setenv(FREEZE_ENV, "1")
    assert freeze_import_time_objects(enabled=False) == 0  # never touches the collector

    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert is_verbose() and not is_verbose(False)
    monkeypatch.setenv(VERBOSE_ENV, "0")
    assert not is_verbose() and is_verbose(True)


def test_the_process_flags_win_over_the_environment_and_leave_the_command_line(monkeypatch):
    from dynatrain.cli import main
    from dynatrain.cli.process_flags import take_process_flags
    from dynatrain.settings import VERBOSE_ENV
    from dynatrain.settings import FREEZE_ENV, HEAP_ENV

    monkeypatch.setenv(HEAP_ENV, "reuse")
    monkeypatch.setenv(FREEZE_ENV, "1")
    monkeypatch.setenv(VERBOSE_ENV, "0")
    argv = ["fit", "--heap", "glibc", "--config", "x.yaml", "--verbose", "--no-gc-freeze", "--trainer.max_steps=2"]
    assert take_process_flags(argv) == ["fit", "--config", "x.yaml", "--trainer.max_steps=2"]
    assert (os.environ[HEAP_ENV], os.environ[FREEZE_ENV], os.environ[VERBOSE_ENV]) == ("glibc", "0", "1")
    assert take_process_flags(["join", "--heap=reuse", "--gc-freeze"]) == ["join"]
    assert (os.environ[HEAP_ENV], os.environ[FREEZE_ENV]) == ("reuse", "1")
    with pytest.raises(ValueError, match="--heap 'none'"):
        take_process_flags(["fit", "--heap", "none"])
    with pytest.raises(ValueError, match="needs a value"):
        take_process_flags(["fit", "--heap"])
    assert main(["fit", "--heap", "none"]) == 2


def _env(**env: str) -> dict[str, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("DYNATRAIN_")}
    full.update(PYTHONPATH=str(REPO), **env)
    return full


def _start(code: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


def _fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_env(**env), capture_output=True,
                          text=True, timeout=240, cwd=REPO)


def test_importing_dynatrain_changes_nothing_but_the_strategy_registration():
    proc = _fresh("""
        import gc, os, sys
        env, meta = dict(os.environ), list(sys.meta_path)
        import dynatrain
        assert gc.get_freeze_count() == 0, gc.get_freeze_count()
        assert dict(os.environ) == env
        added = [f for f in sys.meta_path if f not in meta]
        assert [type(f).__name__ for f in added] == ["_AfterLightning"], added  # the registration, until Lightning
        import lightning.pytorch
        from lightning.pytorch.strategies import StrategyRegistry
        assert StrategyRegistry["dynatrain"]["strategy"] is dynatrain.DynaTrainStrategy
        assert not [f for f in sys.meta_path if type(f).__name__ == "_AfterLightning"]  # the hook removed itself
        assert gc.get_freeze_count() == 0, gc.get_freeze_count()
        assert dict(os.environ) == env
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_training_entry_point_freezes_before_any_model_and_the_flag_turns_it_off(monkeypatch):
    from dynatrain.runtime.memory import freeze_import_time_objects
    from dynatrain.settings import FREEZE_ENV

    code = """
        import gc, sys
        import dynatrain.cli.train as train

        def instead_of_the_cli(*args, **kwargs):  # where the model and Trainer would be built
            print(gc.get_freeze_count())
            raise SystemExit(0)

        train._DynaTrainCLI = instead_of_the_cli
        from dynatrain.cli import main
        main(sys.argv[1:])
    """
    procs = [_start(code.replace("sys.argv[1:]", repr(argv))) for argv in (["fit"], ["fit", "--no-gc-freeze"])]
    (frozen, err), (off, err_off) = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], (err + err_off)[-3000:]
    assert int(frozen.split()[-1]) > 100_000  # torch's and Lightning's import-time objects
    assert int(off.split()[-1]) == 0
    monkeypatch.setenv(FREEZE_ENV, "0")  # what --no-gc-freeze hands on; in this process it freezes nothing
    assert freeze_import_time_objects() == 0


def test_the_zygote_of_forked_ranks_freezes_what_it_preloaded(tmp_path):
    from dynatrain.launch.local import launch_local

    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import gc, json, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        open(out, "w").write(json.dumps({"frozen": gc.get_freeze_count()}))
    """))
    [result] = launch_local([str(script)], 1, tmp_path, timeout=120, name="freeze", preload=("dynatrain",))
    assert result["frozen"] > 0
