"""A world whose peer is gone (`elastic.broken_world`): NCCL's error handling left to Python, and the groups ended
by an abort, which never waits for the dead peer, with a destroy where no abort is to be had."""

import multiprocessing as mp
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dynatrain.elastic.broken_world import (
    CLEAN_UP_ONLY, ERROR_HANDLING_ENV, LEGACY_ERROR_HANDLING_ENV, abort_groups, let_python_see_nccl_errors,
)
from dynatrain.elastic.world import WorldGeneration


def test_an_nccl_world_lets_python_see_a_lost_peer_unless_the_user_chose():
    env = {}
    assert let_python_see_nccl_errors("gloo", env) is None and env == {}  # gloo raises in Python anyway
    assert let_python_see_nccl_errors("cpu:gloo,cuda:nccl", env) == CLEAN_UP_ONLY
    assert env == {ERROR_HANDLING_ENV: CLEAN_UP_ONLY}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert let_python_see_nccl_errors("nccl", {ERROR_HANDLING_ENV: "0"}) == "0"  # kept, and no teardown
    for name, value in [(ERROR_HANDLING_ENV, "3"), (LEGACY_ERROR_HANDLING_ENV, "1")]:
        env = {name: value}
        with pytest.warns(UserWarning, match=f"{name}={value}.*cannot recover from replicas"):
            assert let_python_see_nccl_errors("nccl", env) == value
        assert env == {name: value}


def _store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _one_generation(store, generation: int) -> WorldGeneration:
    world = WorldGeneration.join(store, generation, "m0", ["m0"], timeout=20, backend="gloo")
    dist.new_group([0])  # a sub-group, as a mesh makes: it must end with the world
    t = torch.ones(2)
    dist.all_reduce(t)
    return world


def test_an_aborted_generation_ends_every_group_and_the_next_one_forms():
    store = _store()
    world = _one_generation(store, 0)
    assert world.abort() == "aborted" and not dist.is_initialized()
    assert world.abort() == "none"  # once only
    from torch.distributed.distributed_c10d import _world

    assert not _world.pg_map and _world.group_count == 0  # the group names restart alike on every survivor
    _one_generation(store, 1).leave()
    assert not dist.is_initialized()


def test_without_an_abort_in_torch_or_where_it_fails_the_groups_are_destroyed(monkeypatch):
    from torch.distributed import distributed_c10d as c10d

    store = _store()
    monkeypatch.delattr(c10d, "_abort_process_group")
    assert _one_generation(store, 0).abort() == "destroyed" and not dist.is_initialized()

    def refuses(group=None):
        raise RuntimeError("abort is not supported")

    monkeypatch.setattr(c10d, "_abort_process_group", refuses, raising=False)
    world = _one_generation(store, 1)
    with pytest.warns(UserWarning, match="abort is not supported.*destroying what is left"):
        assert world.abort() == "destroyed"
    assert not dist.is_initialized()
    assert abort_groups() == "none"


def _member(rank: int, port: int, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    world = WorldGeneration.join(store, 0, f"m{rank}", ["m0", "m1"], timeout=20, backend="gloo")
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 1:
        import os

        os._exit(0)  # lost: no goodbye
    pending = dist.irecv(torch.zeros(2), src=1)  # work the dead peer never completes
    try:
        dist.all_reduce(t)
        out.put(("no error", 0.0, []))
        return
    except RuntimeError:
        pass
    start = time.monotonic()
    how = world.abort()
    took = time.monotonic() - start
    alone = WorldGeneration.join(store, 1, "m0", ["m0"], timeout=20, backend="gloo")
    x = torch.full((2,), 3.0)
    dist.all_reduce(x)
    alone.leave()
    del pending
    out.put((how, took, x.tolist()))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_survivor_aborts_the_world_of_a_dead_peer_at_once_and_goes_on_alone():
    store = _store()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, store.port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        how, took, reduced = out.get(timeout=90)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert how == "aborted" and took < 5.0, (how, took)
    assert reduced == [3.0, 3.0]  # a collective of the world the survivor formed alone
    assert procs[0].exitcode == 0


def test_an_nccl_world_is_bound_to_the_process_current_device(monkeypatch):
    import torch

    from dynatrain.elastic.world import _bound_device

    assert _bound_device("gloo") == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _bound_device("nccl") == {"device_id": torch.device("cuda", 1)}
    assert _bound_device("cpu:gloo,cuda:nccl") == {"device_id": torch.device("cuda", 1)}
    assert _bound_device("gloo") == {}
