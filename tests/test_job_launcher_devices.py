"""`dynatrain fit --elastic.*` gives every process it starts a device of its own, as torchrun gives its workers
theirs: members their rank, standby processes the lowest free index, kept through leaving and waiting again."""

import itertools
import os

import pytest

from dynatrain.launch import job as job_launcher
from dynatrain.cli.devices import own_device
from dynatrain.launch.job import ElasticLauncher, free_device, member_env, standby_env


def test_a_member_gets_its_rank_as_its_local_device():
    env = member_env({"PATH": "/bin", "OMP_NUM_THREADS": "1"}, 2, 4)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")} == {
        "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "0"}


def test_a_standby_process_gets_a_device_and_no_rank_and_join_makes_it_its_only_gpu():
    env = standby_env({"PATH": "/bin", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, 3)
    assert env["LOCAL_RANK"] == "3" and not {"RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"} & set(env)
    assert env["OMP_NUM_THREADS"] == "1"  # while it waits
    assert own_device(None, env) == "3"
    assert own_device(None, {**env, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "7"  # an index among the visible ones


def test_the_free_device_is_the_lowest_no_live_process_holds():
    assert free_device([0, 1], 4) == 2
    assert free_device([1, 3], 4) == 0
    with pytest.raises(RuntimeError, match="every one of the 2 local devices is held"):
        free_device([0, 1], 2)


class _Proc:
    pids = itertools.count(100)

    def __init__(self, cmd, env):
        self.cmd, self.env, self.pid, self.code = cmd, env, next(self.pids), None

    def poll(self):
        return self.code


def test_standby_processes_never_share_a_device_with_each_other_or_a_member(monkeypatch, capsys):
    started = []

    def popen(cmd, env):
        started.append(_Proc(cmd, env))
        return started[-1]

    monkeypatch.setattr(job_launcher.subprocess, "Popen", popen)
    launcher = ElasticLauncher({"devices": 2, "max_devices": 5, "standby": 2}, ["fit"])
    launcher.env = {"PATH": "/bin"}
    for rank in range(2):
        launcher._start_member(rank, 2, ["fit"])
    launcher._refill()
    assert [p.env["LOCAL_RANK"] for p in started] == ["0", "1", "2", "3"]
    assert [p.cmd[-1] for p in started[2:]] == ["join", "join"]
    # Member 0 is killed and a standby is admitted: the pool is refilled on the device member 0 held.
    started[0].code = -9
    launcher.procs[started[2].pid] = (started[2], "member")
    launcher._refill()
    assert started[-1].env["LOCAL_RANK"] == "0"
    assert f"standby process {started[-1].pid} started on local device 0" in capsys.readouterr().out
    # The pool is full again: nothing more starts.
    launcher._refill()
    assert len(started) == 5 and sorted(launcher.devices_of[p.pid] for p in started if p.poll() is None) == [0, 1, 2, 3]


def test_a_member_that_leaves_and_waits_again_keeps_its_device(monkeypatch):
    from dynatrain.cli import train

    execs = []

    def execv(path, argv):
        execs.append((argv, dict(os.environ)))

    monkeypatch.setattr(train.os, "execv", execv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    train._stay_as_standby()
    argv, env = execs[-1]
    assert argv[-1] == "join" and env["CUDA_VISIBLE_DEVICES"] == "1" and "LOCAL_RANK" not in env
    # A process that joined before has its one GPU visible and no local rank: it keeps it as it is.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")
    train._stay_as_standby()
    assert execs[-1][1]["CUDA_VISIBLE_DEVICES"] == "6"
