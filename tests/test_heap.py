"""The heap settings a training process dynatrain starts gets unless ``DYNATRAIN_HEAP=glibc``
(`dynatrain.runtime.memory.heap_env`)."""

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from dynatrain.launch.local import joiner_env, rank_env
from dynatrain.runtime.memory import HEAP_TUNABLES, TUNABLES_ENV, heap_env
from dynatrain.settings import HEAP_ENV

OURS = [f"{k}={v}" for k, v in HEAP_TUNABLES]
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch):
    monkeypatch.delenv(TUNABLES_ENV, raising=False)
    monkeypatch.delenv(HEAP_ENV, raising=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GLIBC_TUNABLES is read on Linux only")
def test_the_settings_are_added_and_a_users_own_are_kept():
    on = {HEAP_ENV: "reuse"}
    assert heap_env({"A": "1", **on}) == {"A": "1", **on, TUNABLES_ENV: ":".join(OURS)}
    mine = "glibc.malloc.trim_threshold=4096:glibc.pthread.rseq=0"
    got = heap_env({TUNABLES_ENV: mine, **on})[TUNABLES_ENV].split(":")
    assert got[:2] == mine.split(":")
    assert [t for t in got if t.startswith("glibc.malloc.trim_threshold")] == ["glibc.malloc.trim_threshold=4096"]
    assert set(got) == set(mine.split(":")) | {t for t in OURS if not t.startswith("glibc.malloc.trim_threshold")}
    assert heap_env(heap_env(on)) == heap_env(on)  # a process started with them adds nothing


def test_on_by_default_glibc_leaves_the_environment_alone_and_a_typo_is_refused():
    if sys.platform.startswith("linux"):
        assert heap_env({"A": "1"}) == {"A": "1", TUNABLES_ENV: ":".join(OURS)}
    assert heap_env({HEAP_ENV: "glibc", "A": "1"}) == {HEAP_ENV: "glibc", "A": "1"}
    with pytest.raises(ValueError, match=r"DYNATRAIN_HEAP='reus'.*'reuse'.*'glibc'"):
        heap_env({HEAP_ENV: "reus"})
    with pytest.raises(ValueError, match=r"'default' named glibc's own settings.*now say 'glibc'"):
        heap_env({HEAP_ENV: "default"})  # what it meant before the settings became the default


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GLIBC_TUNABLES is read on Linux only")
def test_the_launchers_start_ranks_and_joiners_with_them(monkeypatch):
    for env in (rank_env(1, 2, 29500), joiner_env({}, 3)):
        assert env[TUNABLES_ENV].split(":") == OURS
    monkeypatch.setenv(HEAP_ENV, "glibc")
    assert TUNABLES_ENV not in rank_env(1, 2, 29500) and TUNABLES_ENV not in joiner_env({}, 3)
    # The launchers' argument wins over the environment, and the ranks carry it on to what they start.
    for env in (rank_env(1, 2, 29500, heap="reuse"), joiner_env({}, 3, heap="reuse")):
        assert env[TUNABLES_ENV].split(":") == OURS and env[HEAP_ENV] == "reuse"
    monkeypatch.setenv(HEAP_ENV, "reuse")
    env = rank_env(1, 2, 29500, heap="glibc")
    assert TUNABLES_ENV not in env and env[HEAP_ENV] == "glibc"


def test_a_training_command_restarts_itself_once_with_them(monkeypatch):
    import dynatrain.cli as cli

    calls = []
    monkeypatch.setattr(cli.os, "execve", lambda exe, argv, env: calls.append((argv, env)))
    import dynatrain.cli.train as train

    monkeypatch.setattr(train, "run_lightning_cli", lambda argv: 0)
    monkeypatch.setattr(sys, "argv", ["dynatrain", "fit", "--config", "x.yaml"])
    monkeypatch.setenv(HEAP_ENV, "glibc")
    assert cli.main() == 0 and calls == []  # glibc's own: nothing to restart for
    monkeypatch.delenv(HEAP_ENV)  # the default
    assert cli.main() == 0
    [(argv, env)] = calls
    assert argv == [sys.executable, "-m", "dynatrain.cli", "fit", "--config", "x.yaml"]
    assert env == heap_env(dict(cli.os.environ))
    if sys.platform.startswith("linux"):
        assert env[TUNABLES_ENV].split(":") == OURS
        # Started over with them, it runs on.
        calls.clear()
        monkeypatch.setenv(TUNABLES_ENV, env[TUNABLES_ENV])
        assert cli.main() == 0 and calls == []
    # Called as a function, or for a command that trains nothing, it never replaces the process.
    monkeypatch.delenv(TUNABLES_ENV, raising=False)
    assert cli.main(["fit", "--config", "x.yaml"]) == 0 and calls == []
    monkeypatch.setattr(sys, "argv", ["dynatrain", "plan", "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    assert calls == []
    monkeypatch.setenv(HEAP_ENV, "none")
    monkeypatch.setattr(sys, "argv", ["dynatrain", "join"])
    assert cli.main() == 2 and calls == []
    # --heap wins over the environment, before the restart, and leaves the command line the process restarts with.
    monkeypatch.setattr(sys, "argv", ["dynatrain", "fit", "--heap", "glibc", "--config", "x.yaml"])
    assert cli.main() == 0 and calls == [] and cli.os.environ[HEAP_ENV] == "glibc"
    monkeypatch.setattr(sys, "argv", ["dynatrain", "fit", "--heap=reuse", "--config", "x.yaml"])
    assert cli.main() == 0
    [(argv, env)] = calls
    assert argv == [sys.executable, "-m", "dynatrain.cli", "fit", "--config", "x.yaml"] and env[HEAP_ENV] == "reuse"


PROBE = textwrap.dedent("""
    import json, resource, sys, threading, torch
    mib, where = int(sys.argv[1]), sys.argv[2]
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    faults, sizes, keep = [], [], []
    def steps():
        for _ in range(12):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            x = torch.empty(mib * 2**18)  # written in full: a gathered weight or a gradient
            x.fill_(1.0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            keep.append(torch.empty(10))  # small blocks taken in between, as a step takes them
            del x
            sizes.append(rss())
    if where == "thread":  # as a collective's thread allocates its buffers
        t = threading.Thread(target=steps)
        t.start()
        t.join()
    else:
        steps()
    print(json.dumps({"faults": faults, "rss": sizes}))
""")


def _probe(env, mib: int = 64, where: str = "main") -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(mib), where], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
@pytest.mark.parametrize("threads", ["1", "2"])  # with two, the cache off alone let the heap grow
def test_with_them_a_freed_block_is_reused_and_the_heap_stays_flat(threads):
    import os

    pages = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    plain = _probe({**os.environ, HEAP_ENV: "glibc", "OMP_NUM_THREADS": threads})
    ours = _probe({**heap_env({**os.environ, HEAP_ENV: "reuse"}), "OMP_NUM_THREADS": threads})
    # glibc's defaults map a block this large afresh every time; with the settings only the first time.
    assert min(plain["faults"][2:]) > pages // 2, plain
    assert max(ours["faults"][2:]) < pages // 20, ours
    assert ours["rss"][-1] - ours["rss"][1] < 8 * 2**20, ours


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
def test_with_them_a_thread_reuses_a_block_larger_than_its_own_arena_could_hold():
    import os

    mib = 96  # above the 64 MiB of a thread arena's heap
    pages = mib * 2**20 // os.sysconf("SC_PAGE_SIZE")
    ours = _probe(heap_env({**os.environ, HEAP_ENV: "reuse"}), mib, "thread")
    # The settings but one: a user's own arena_max is kept.
    per_thread = _probe(heap_env({**os.environ, HEAP_ENV: "reuse", TUNABLES_ENV: "glibc.malloc.arena_max=64"}),
                        mib, "thread")
    # With an arena per thread glibc maps such a block afresh every time, settings or not; with one arena, once.
    assert min(per_thread["faults"][2:]) > pages // 2, per_thread
    assert max(ours["faults"][2:]) < pages // 20, ours
    assert ours["rss"][-1] - ours["rss"][1] < 8 * 2**20, ours


def test_the_heap_is_trimmed_only_past_the_largest_footprint(monkeypatch):
    from dynatrain.runtime import memory

    trims, rss = [], []
    monkeypatch.setattr(memory, "_footprint", [])
    monkeypatch.setattr(memory, "_malloc_trim", lambda pad: trims.append(pad) or rss.__setitem__(0, 1500))
    monkeypatch.setattr(memory, "resident_bytes", lambda: rss[0])

    def switch(before, after):
        rss[:] = [after]
        return memory.release_freed_memory(before)

    assert not switch(1000, 1010)  # within the slack of the footprint the switch started from
    # After a scale-out: the old layout's footprint includes its steps' working memory, which the heap keeps mapped
    # between steps. Trimming it would make the next step map it all again.
    assert not switch(3000, 3050)
    assert not switch(2000, 3050)  # a smaller layout now, still within the largest footprint
    assert switch(2000, 3100) and trims == [0]  # past it by more than the slack: given back
    assert memory._footprint == [3000]  # a trim does not lower the mark
    monkeypatch.setattr(memory, "_footprint", [])
    rss[:] = [800]
    assert not memory.release_freed_memory() and memory._footprint == [800]  # no start given: RSS now is the mark


WARM_PROBE = textwrap.dedent("""
    import json, resource, sys, torch
    from dynatrain.switch.prepare import free_working_bytes, warm_allocator
    mib = 64
    warmed = warm_allocator(mib * 2**20, "cpu") if sys.argv[1] == "warm" else 0
    free = free_working_bytes("cpu")
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(mib * 2**18)  # a first step's working memory, written in full
    x.fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    del x
    print(json.dumps({"warmed": warmed, "free": free, "faults": faults, "again": warm_allocator(mib * 2**20, "cpu")}))
""")


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
def test_a_warmed_allocator_serves_a_first_step_from_mapped_memory():
    import os

    def probe(env, how):
        out = subprocess.run([sys.executable, "-c", WARM_PROBE, how], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    pages = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    ours = heap_env({**os.environ, HEAP_ENV: "reuse"})
    cold, warm = probe(ours, "cold"), probe(ours, "warm")
    assert cold["faults"] > pages // 2, cold
    # Free bytes count small fragments too, so a little under what was asked for may be held in one piece.
    assert warm["warmed"] > 0 and warm["free"] >= 60 * 2**20 and warm["faults"] < pages // 20, warm
    assert warm["again"] < 2**20  # freed by the step, the memory is still held: nothing (or fragments) to add
    # With glibc's own settings a freed block this large is unmapped: no warming.
    plain = probe({**os.environ, HEAP_ENV: "glibc"}, "warm")
    assert plain["warmed"] == 0 and plain["free"] == 0, plain


@pytest.mark.skipif(not GLIBC, reason="glibc's heap")
def test_malloc_figures_count_a_block_while_it_is_held_and_a_trim_keeps_it():
    import torch

    from dynatrain.runtime.memory import malloc_figures, trim_heap

    before = malloc_figures()
    block = torch.ones(64 << 20, dtype=torch.uint8)
    held = malloc_figures()
    assert held["malloc_in_use_bytes"] - before["malloc_in_use_bytes"] >= 64 << 20
    trim_heap()  # gives back free pages only: the block is still there
    assert malloc_figures()["malloc_in_use_bytes"] >= held["malloc_in_use_bytes"] - (1 << 20)
    assert int(block.sum()) == 64 << 20
    del block
    assert malloc_figures()["malloc_in_use_bytes"] < held["malloc_in_use_bytes"] - (60 << 20)
