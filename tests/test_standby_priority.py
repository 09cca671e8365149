"""A standby process waits niced and trains at its normal priority: `dynatrain.elastic.priority`, its refusal where
the priority could not be taken back, and the setting in `ElasticConfig` and `dynatrain fit --elastic.*`."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynatrain.elastic import priority

REPO = Path(__file__).resolve().parent.parent

# In a child process: the pytest process is never niced.
LOWER_AND_RESTORE = """
import json, os, threading
from dynatrain.elastic import priority

def niceness():
    return sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})

out = {"start": niceness(), "lowered": priority.lower(10)}
stop = threading.Event()
thread = threading.Thread(target=stop.wait)
thread.start()  # started while waiting: it inherits the low priority and must get the normal one back as well
out["waiting"] = niceness()
priority.lower(10)
out["again"] = niceness()
priority.restore()
out["admitted"], out["lowered_after"] = niceness(), priority.lowered()
stop.set()
thread.join()
print(json.dumps(out))
"""


def test_a_standby_is_lowered_while_it_waits_and_every_thread_is_restored():
    start = os.getpriority(os.PRIO_PROCESS, 0)
    if start + 10 > priority.MAX_NICE or not priority.restorable(start):
        pytest.skip(f"niceness {start} cannot be raised by 10 and taken back here")
    run = subprocess.run([sys.executable, "-c", LOWER_AND_RESTORE], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out == {"start": [start], "lowered": True, "waiting": [start + 10], "again": [start + 10],
                   "admitted": [start], "lowered_after": False}


@pytest.fixture
def unprivileged(monkeypatch):
    """This process as one without CAP_SYS_NICE whose RLIMIT_NICE soft limit is 0 (the usual default)."""
    monkeypatch.setattr(priority, "_privileged", lambda: False)
    monkeypatch.setattr(priority.resource, "getrlimit", lambda which: (0, 0))
    monkeypatch.setattr(priority, "_refusal_said", False)
    monkeypatch.setattr(priority, "_normal", None)


def test_where_the_priority_could_not_be_taken_back_it_is_never_lowered(unprivileged, caplog):
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with caplog.at_level(logging.WARNING, logger="dynatrain.elastic"):
        assert priority.lower(10) is False
        assert priority.lower(10) is False
    assert os.getpriority(os.PRIO_PROCESS, 0) == before and not priority.lowered()
    [said] = [r.getMessage() for r in caplog.records]  # once per process
    assert f"ulimit -e {20 - before}" in said and "RLIMIT_NICE soft limit 0" in said
    priority.restore()  # nothing to give back


def test_rlimit_nice_decides_how_far_an_unprivileged_process_may_go_back(monkeypatch):
    monkeypatch.setattr(priority, "_privileged", lambda: False)
    monkeypatch.setattr(priority.resource, "getrlimit", lambda which: (15, 15))  # down to niceness 5
    assert priority.restorable(5) and priority.restorable(12) and not priority.restorable(4)
    monkeypatch.setattr(priority.resource, "getrlimit",
                        lambda which: (priority.resource.RLIM_INFINITY, priority.resource.RLIM_INFINITY))
    assert priority.restorable(-20)
    monkeypatch.setattr(priority, "_privileged", lambda: True)
    monkeypatch.setattr(priority.resource, "getrlimit", lambda which: (0, 0))
    assert priority.restorable(-20)


def test_zero_leaves_the_priority_untouched_and_bad_amounts_are_refused(monkeypatch):
    monkeypatch.setattr(priority, "_normal", None)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert priority.lower(0) is False
    assert os.getpriority(os.PRIO_PROCESS, 0) == before and not priority.lowered()
    for bad in (-1, 20, True, 2.5):
        with pytest.raises(ValueError, match="standby_nice must be an integer from 0"):
            priority.lower(bad)


def test_the_setting_reaches_the_config_and_the_launcher(monkeypatch):
    from dynatrain.launch.job import ElasticLauncher, split_elastic_args
    from dynatrain.elastic.manager import ElasticConfig

    assert ElasticConfig().standby_nice == priority.DEFAULT_STANDBY_NICE == 4
    with pytest.raises(ValueError, match="elastic standby_nice must be an integer from 0"):
        ElasticConfig(standby_nice=25)
    opts, _ = split_elastic_args(["fit", "--elastic.standby", "2", "--elastic.standby_nice", "5"])
    launcher = ElasticLauncher(opts, ["fit"])
    assert launcher.standby == 2 and launcher.config["standby_nice"] == 5
    # The launcher carries it to its processes in the JSON config they read as the strategy's default.
    carried = {"DYNATRAIN_ELASTIC": json.dumps(launcher.config)}
    assert priority.launcher_amount(carried) == 5 and priority.launcher_amount({}) == priority.DEFAULT_STANDBY_NICE
    assert ElasticConfig.parse(json.loads(carried["DYNATRAIN_ELASTIC"])).standby_nice == 5
    with pytest.raises(ValueError, match="--elastic.standby_nice must be an integer from 0"):
        ElasticLauncher({"standby_nice": -3}, ["fit"])
