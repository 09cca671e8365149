"""Ranks forked from one preloaded process (`launch_local(preload=...)`) run as plain `python script` ranks do, and
the launcher sees their failures and deaths as it sees a plain rank's, whether that process serves one launch or is
kept for every launch (`keep_zygote`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _launch import wait_for

from dynatrain.launch.local import LaunchError, launch_local

PROBE = Path(__file__).parent / "workers" / "forked_probe.py"
LIGHT = ("xml.dom.minidom",)  # a module no probe imports: it is there only if the rank was forked after preloading


def _run(tmp_path, preload, *args, env=None, **kw):
    return launch_local([str(PROBE), *args], 3, tmp_path, timeout=60, env={"PROBE": "yes", **(env or {})},
                        name="probe", preload=preload, **kw)


KEEP = pytest.mark.parametrize("keep", [False, True], ids=["own-zygote", "kept-zygote"])


@KEEP
def test_a_forked_rank_sees_what_a_started_rank_sees(tmp_path, keep):
    plain = _run(tmp_path / "plain", ())
    forked = _run(tmp_path / "forked", LIGHT, keep_zygote=keep)
    assert [r["preloaded"] for r in plain] == [False] * 3 and [r["preloaded"] for r in forked] == [True] * 3
    for a, b in zip(plain, forked):
        a.pop("preloaded"), b.pop("preloaded"), a.pop("zygote_parent"), b.pop("zygote_parent")
        a["argv"][-1], b["argv"][-1] = Path(a["argv"][-1]).name, Path(b["argv"][-1]).name  # --out differs by port
        assert {**a, "argv": a["argv"][:-1]} == {**b, "argv": b["argv"][:-1]}
    assert forked[2] == {**forked[2], "rank": 2, "world": "3", "argv0": "forked_probe.py", "main_file": "forked_probe.py",
                         "path0": str(PROBE.parent), "probe_env": "yes"}


def test_a_kept_zygote_forks_every_launch_with_its_environment_and_another_one_gets_its_own(tmp_path):
    env = {"PROBE_LAUNCHES": "kept"}  # a zygote of this test's own, whatever ran before it
    first = _run(tmp_path / "a", LIGHT, env=env, keep_zygote=True)
    second = _run(tmp_path / "b", LIGHT, env=env, keep_zygote=True)
    other = _run(tmp_path / "c", LIGHT, env={"PROBE_LAUNCHES": "other"}, keep_zygote=True)
    own = [_run(tmp_path / f"own{i}", LIGHT, env=env)[0]["zygote_parent"] for i in range(2)]
    servers = {r["zygote_parent"] for r in first + second}
    assert len(servers) == 1 and servers.isdisjoint(r["zygote_parent"] for r in other)
    assert own == [os.getpid()] * 2 and os.getpid() not in servers  # a zygote of its own is a child of the launcher


@KEEP
def test_a_forked_rank_that_fails_stops_the_launch_with_its_log(tmp_path, keep):
    started = time.monotonic()
    with pytest.raises(LaunchError) as err:
        _run(tmp_path, LIGHT, "--fail-rank", "1", keep_zygote=keep)
    assert time.monotonic() - started < 30  # its peers, asleep for 60 s, were killed
    text = str(err.value)
    # the peers count as failed too (killed), as with plain processes; the log says which one started it
    assert "probe: ranks [0, 1, 2] failed" in text and "rank 1 fails on purpose" in text


    if keep:  # the zygote outlives its failed launch and forks the next one
        assert [r["rank"] for r in _run(tmp_path / "after", LIGHT, keep_zygote=True)] == [0, 1, 2]


@KEEP
def test_a_forked_rank_killed_by_a_signal_is_a_death_the_launch_may_expect(tmp_path, keep):
    results = _run(tmp_path / "expected", LIGHT, "--kill-rank", "2", may_die=[2], keep_zygote=keep)
    assert results[2] is None and [r["rank"] for r in results[:2]] == [0, 1]
    with pytest.raises(LaunchError, match=r"ranks \[2\] failed"):
        _run(tmp_path / "unexpected", LIGHT, "--kill-rank", "2", keep_zygote=keep)


@KEEP
def test_a_preload_that_cannot_be_imported_is_reported(tmp_path, keep):
    with pytest.raises(LaunchError) as err:
        _run(tmp_path, ("no_such_module_here",), keep_zygote=keep)
    assert "zygote" in str(err.value) and "No module named 'no_such_module_here'" in str(err.value)


def test_at_most_two_zygotes_are_kept_and_the_least_recently_used_one_ends(tmp_path):
    from dynatrain.launch import local as launcher

    def ended(pid: int) -> bool:  # gone, or a zombie of this process's
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    parents = [_run(tmp_path / v, LIGHT, env={"PROBE_LAUNCHES": v}, keep_zygote=True)[0]["zygote_parent"]
               for v in ("x", "y", "x", "z")]  # x used again after y: y is the least recently used when z comes
    kept = [s.proc.pid for s in launcher._SERVERS.values()]
    assert launcher.KEPT_ZYGOTES == 2 and kept == [parents[0], parents[3]] and parents[2] == parents[0]
    wait_for(lambda: ended(parents[1]))


def test_closing_a_served_launch_whose_group_just_ended_waits_for_its_status(tmp_path):
    """The server reaps a launch's zygote, then writes its status: a close in between finds no group to kill."""
    import subprocess
    import sys
    import threading
    from types import SimpleNamespace

    from dynatrain.launch.local import _ServedLaunch

    ended = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    ended.wait()  # reaped: its process group is gone
    launch = object.__new__(_ServedLaunch)
    launch.server = SimpleNamespace(proc=SimpleNamespace(poll=lambda: None))  # a server still running
    launch.pid, launch.rc_file = ended.pid, tmp_path / "zygote.log.rc"
    writer = threading.Timer(0.3, lambda: launch.rc_file.write_text("0"))
    writer.start()
    launch.close()
    writer.join()
    assert launch.poll() == 0


def _ended(pid: int) -> bool:
    """Gone, or a zombie no one reaps yet (its parent died too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@KEEP
def test_the_ranks_of_a_launch_end_when_its_caller_is_killed(tmp_path, keep):
    hang = tmp_path / "pid"
    code = (f"from dynatrain.launch.local import launch_local; launch_local([{str(PROBE)!r}, '--hang', {str(hang)!r}], 2, "
            f"__import__('pathlib').Path({str(tmp_path)!r}), timeout=120, preload={LIGHT!r}, keep_zygote={keep})")
    caller = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path)
    try:
        wait_for(lambda: all(Path(f"{hang}.{r}").exists() for r in range(2)), 60)
        ranks = [int(Path(f"{hang}.{r}").read_text()) for r in range(2)]
        assert not any(_ended(pid) for pid in ranks)
    finally:
        caller.kill()  # as a test run stopped from outside: no clean-up of its own runs
        caller.wait()
    wait_for(lambda: all(_ended(pid) for pid in ranks), 10)


def test_a_launch_on_a_port_used_before_in_its_folder_reports_its_own_ranks(tmp_path, monkeypatch):
    """A store's port is free again once the store is gone: a later launch may get the same one, and the earlier
    launch's results and exit statuses under the same names must not pass for its own."""
    import json

    from dynatrain.launch import local as launcher

    script = tmp_path / "says.py"
    script.write_text("import argparse, json, os\nap = argparse.ArgumentParser()\nap.add_argument('--out')\n"
                      "ap.add_argument('--word')\na = ap.parse_args()\n"
                      "json.dump({'word': a.word, 'rank': int(os.environ['RANK'])}, open(a.out, 'w'))\n")

    class SamePort:
        port = 29999

    monkeypatch.setattr(launcher, "host_store", lambda: SamePort())
    runs = [launcher.launch_local([str(script), "--word", word], 2, tmp_path, name="says", timeout=60,
                                  preload=["json"]) for word in ("first", "second")]
    assert [[r["word"] for r in run] for run in runs] == [["first"] * 2, ["second"] * 2], json.dumps(runs)
