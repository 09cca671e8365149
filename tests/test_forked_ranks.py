"""Ranks forked from one preloaded process (`launch_local(preload=...)`) run as plain `python script` ranks do, and
the launcher sees their failures and deaths as it sees a plain rank's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dynatrain.launcher import LaunchError, launch_local

PROBE = Path(__file__).parent / "workers" / "forked_probe.py"
LIGHT = ("xml.dom.minidom",)  # a module no probe imports: it is there only if the rank was forked after preloading


def _run(tmp_path, preload, *args, **kw):
    return launch_local([str(PROBE), *args], 3, tmp_path, timeout=60, env={"PROBE": "yes"}, name="probe",
                        preload=preload, **kw)


def test_a_forked_rank_sees_what_a_started_rank_sees(tmp_path):
    plain = _run(tmp_path / "plain", ())
    forked = _run(tmp_path / "forked", LIGHT)
    assert [r["preloaded"] for r in plain] == [False] * 3 and [r["preloaded"] for r in forked] == [True] * 3
    for a, b in zip(plain, forked):
        a.pop("preloaded"), b.pop("preloaded")
        a["argv"][-1], b["argv"][-1] = Path(a["argv"][-1]).name, Path(b["argv"][-1]).name  # --out differs by port
        assert {**a, "argv": a["argv"][:-1]} == {**b, "argv": b["argv"][:-1]}
    assert forked[2] == {**forked[2], "rank": 2, "world": "3", "argv0": "forked_probe.py", "main_file": "forked_probe.py",
                         "path0": str(PROBE.parent), "probe_env": "yes"}


def test_a_forked_rank_that_fails_stops_the_launch_with_its_log(tmp_path):
    started = time.monotonic()
    with pytest.raises(LaunchError) as err:
        _run(tmp_path, LIGHT, "--fail-rank", "1")
    assert time.monotonic() - started < 30  # its peers, asleep for 60 s, were killed
    text = str(err.value)
    # the peers count as failed too (killed), as with plain processes; the log says which one started it
    assert "probe: ranks [0, 1, 2] failed" in text and "rank 1 fails on purpose" in text


def test_a_forked_rank_killed_by_a_signal_is_a_death_the_launch_may_expect(tmp_path):
    results = _run(tmp_path / "expected", LIGHT, "--kill-rank", "2", may_die=[2])
    assert results[2] is None and [r["rank"] for r in results[:2]] == [0, 1]
    with pytest.raises(LaunchError, match=r"ranks \[2\] failed"):
        _run(tmp_path / "unexpected", LIGHT, "--kill-rank", "2")


def test_a_preload_that_cannot_be_imported_is_reported(tmp_path):
    with pytest.raises(LaunchError) as err:
        _run(tmp_path, ("no_such_module_here",))
    assert "zygote" in str(err.value) and "No module named 'no_such_module_here'" in str(err.value)
