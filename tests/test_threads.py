"""Intra-op threads: the host's cores split among a job's processes, again after every world change, and only where
dynatrain chose the count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import dynatrain.runtime.threads as threads
from dynatrain.elastic.manager import ElasticConfig, ElasticManager
from dynatrain.elastic.registry import register
from dynatrain.launch.local import joiner_env, rank_env
from dynatrain.runtime.threads import SPLIT, launch_env, mark_if_unset, resplit, share
from dynatrain.settings import THREADS_ENV


@pytest.fixture
def cores(monkeypatch):
    monkeypatch.setattr(threads, "host_cores", lambda: 12)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_each_process_gets_its_share_of_the_cores(cores):
    assert [share(n) for n in (1, 2, 5, 12, 40)] == [12, 6, 2, 1, 1]
    with pytest.raises(ValueError, match="processes must be at least 1, got 0"):
        share(0)


def test_a_launch_marks_the_count_it_chose_and_keeps_the_users(cores, monkeypatch):
    assert launch_env({"A": "1"}, 4) == {"A": "1", "OMP_NUM_THREADS": "3", THREADS_ENV: SPLIT}
    assert launch_env({}, 4, start=1) == {"OMP_NUM_THREADS": "1", THREADS_ENV: SPLIT}
    assert launch_env({"OMP_NUM_THREADS": "7"}, 4) == {"OMP_NUM_THREADS": "7"}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(THREADS_ENV, raising=False)
    member = rank_env(1, 3, 29500)
    assert (member["OMP_NUM_THREADS"], member[THREADS_ENV]) == ("4", SPLIT)
    joiner = joiner_env({}, 6)
    assert (joiner["OMP_NUM_THREADS"], joiner[THREADS_ENV]) == ("2", SPLIT)
    assert THREADS_ENV not in rank_env(0, 3, 29500, {"OMP_NUM_THREADS": "5"})


def test_a_process_without_a_count_of_its_own_is_marked(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(THREADS_ENV, raising=False)
    mark_if_unset()
    assert threads.os.environ[THREADS_ENV] == SPLIT
    monkeypatch.delenv(THREADS_ENV)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    mark_if_unset()
    assert THREADS_ENV not in threads.os.environ


def test_a_world_change_splits_the_count_dynatrain_chose_and_leaves_the_users(cores, monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(THREADS_ENV, raising=False)
    torch.set_num_threads(1)
    assert resplit(3) is None and torch.get_num_threads() == 1  # the user's count
    monkeypatch.setenv(THREADS_ENV, SPLIT)
    assert resplit(3) == 4 and torch.get_num_threads() == 4 and threads.os.environ["OMP_NUM_THREADS"] == "4"
    assert resplit(6) == 2 and torch.get_num_threads() == 2  # a scale-out: more processes, a smaller share


def _manager(store, member: str, members: list[str], split_threads: bool | None = None):
    return SimpleNamespace(store=store, member_id=member, world=SimpleNamespace(members=members), thread_splits=[],
                           backend="gloo", config=ElasticConfig(split_threads=split_threads))


def test_the_processes_on_this_host_are_the_worlds_members_registered_from_it(cores, monkeypatch, restore_threads):
    store = dist.HashStore()
    info = {"model_config_hash": "h", "code_version": "v"}
    for member, host in [("a", "n1"), ("b", "n1"), ("c", "n2"), ("d", "n1")]:
        register(store, member, {**info, "host": host})
    me = _manager(store, "a", ["a", "b", "c"])  # d registered from this host but is not in the world
    assert ElasticManager.processes_on_this_host(me) == 2
    assert ElasticManager.processes_on_this_host(_manager(store, "c", ["a", "b", "c", "d"])) == 1
    monkeypatch.setenv(THREADS_ENV, SPLIT)
    me.processes_on_this_host = lambda: ElasticManager.processes_on_this_host(me)
    assert ElasticManager.split_threads(me) == 6 and torch.get_num_threads() == 6 and me.thread_splits == [(2, 6)]
    monkeypatch.delenv(THREADS_ENV)
    assert ElasticManager.split_threads(me) is None
    monkeypatch.setenv(THREADS_ENV, SPLIT)
    me.backend = "cpu:gloo,cuda:nccl"  # a GPU world: the operators run on the device
    assert ElasticManager.split_threads(me) is None and me.thread_splits == [(2, 6)]
    me.backend = "gloo"
    me.world = None  # a member that left
    monkeypatch.setenv(THREADS_ENV, SPLIT)
    assert ElasticManager.split_threads(me) is None


def test_the_elastic_config_says_whether_to_split_before_the_launchers_mark(cores, monkeypatch, restore_threads):
    store = dist.HashStore()
    for member in ("a", "b"):
        register(store, member, {"model_config_hash": "h", "code_version": "v", "host": "n1"})
    monkeypatch.setenv(THREADS_ENV, SPLIT)
    me = _manager(store, "a", ["a", "b"], split_threads=False)  # marked by a launcher, told not to
    me.processes_on_this_host = lambda: ElasticManager.processes_on_this_host(me)
    assert ElasticManager.split_threads(me) is None and me.thread_splits == []
    monkeypatch.delenv(THREADS_ENV)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    me.config = ElasticConfig(split_threads=True)  # the user's count, but told to split
    assert ElasticManager.split_threads(me) == 6 and torch.get_num_threads() == 6
    assert resplit(3) is None and resplit(3, split=True) == 4
