"""The next generation formed beside the current one while it trains (`elastic.next_world`,
`WorldGeneration.form_ahead`), and swapped in at the boundary: the members it keeps `enter` it, the others
`depart`, and training state built on it (a mesh, FSDP) works as on a generation formed in the stall."""

import multiprocessing as mp
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dynatrain.elastic import next_world
from dynatrain.elastic.world import WorldGeneration
from dynatrain.models.mesh_groups import layout_groups
from dynatrain.vps.parallel_config import ParallelConfig

LAYOUT = ParallelConfig.parse("dp_shard=2")

pytestmark = pytest.mark.multiprocess


def _store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _client(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def _member(rank: int, port: int, out) -> None:
    members = ["m0", "m1", "m2"]
    world = WorldGeneration.join(_client(port), 0, members[rank], members, timeout=20, backend="gloo")
    stays = rank < 2
    # With the mesh's groups of the layout the two will train as (`layout_groups`), formed beside it.
    groups = layout_groups(LAYOUT, [0, 1])
    ahead = world.form_ahead(lambda: _client(port), ["m0", "m1"], subgroups=groups) if stays else None
    steps, x = 0, torch.ones(1 << 16)
    while True:  # the old world trains meanwhile; every member leaves it at the same boundary
        dist.all_reduce(x)
        steps += 1
        formed = torch.tensor([1.0 if ahead is None or ahead.formation.done() else 0.0])
        dist.all_reduce(formed, op=dist.ReduceOp.MIN)
        if steps >= 5 and formed.item() == 1.0:
            break
    if not stays:
        world.depart()
        out.put((rank, "left", dist.is_initialized()))
        return
    start = time.perf_counter()
    world = world.enter(ahead)
    entered = time.perf_counter() - start
    from torch.distributed.distributed_c10d import _world
    from torch.distributed.fsdp import fully_shard

    from dynatrain.strategies.mesh_cache import MeshCache

    assert (world.generation, dist.get_rank(), dist.get_world_size()) == (1, rank, 2)
    made = _world.group_count
    mesh = MeshCache().get(LAYOUT, torch.device("cpu"))
    # Every group of the mesh is one formed ahead: none is made at the boundary.
    assert _world.group_count == made
    assert mesh["dp_shard"].get_group() is next_world.formed_subgroup([0, 1])
    assert mesh["tp"].get_group() is next_world.formed_subgroup([rank])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    fully_shard(model, mesh=mesh["dp_shard"])
    model(torch.ones(4, 8)).sum().backward()
    grad = model.weight.grad.full_tensor()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    world.leave()
    out.put((rank, "stayed", (entered, float(total), float(grad.sum()))))


@pytest.mark.timeout(120)
def test_the_next_world_forms_while_the_old_one_trains_and_is_entered_at_the_boundary():
    store = _store()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, store.port, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        results = dict((r, (how, what)) for r, how, what in (out.get(timeout=90) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results[2] == ("left", False), results  # it departed: no group left, no barrier it waited in
    for r in (0, 1):
        how, (entered, total, grad) = results[r]
        assert how == "stayed" and total == 3.0, results  # the entered generation's own collectives
        assert entered < 1.0, entered  # a swap, not a formation
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 8)
    ref(torch.ones(4, 8)).sum().backward()
    # FSDP on the entered world: each rank's gradient is the mean over the two ranks' identical batches.
    assert results[0][1][2] == pytest.approx(float(ref.weight.grad.sum()), rel=1e-5)
    assert [p.exitcode for p in procs] == [0, 0, 0]


def _discarder(port: int, out) -> None:
    world = WorldGeneration.join(_client(port), 0, "d0", ["d0"], timeout=20, backend="gloo")
    # "ghost" never comes: the formation waits for it until given up on.
    ahead = world.form_ahead(lambda: _client(port), ["d0", "ghost"])
    time.sleep(0.2)
    start = time.monotonic()
    ahead.discard()
    error = None
    try:
        ahead.formation.result(timeout=5)
    except RuntimeError as e:
        error = str(e)
    out.put((time.monotonic() - start, error))
    world.leave()


@pytest.mark.timeout(90)
def test_a_formation_given_up_on_ends_at_once_and_the_process_exits_cleanly():
    store = _store()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_discarder, args=(store.port, out))
    p.start()
    try:
        took, error = out.get(timeout=60)
    finally:
        p.join(timeout=30)
    assert took < 2.0 and "cancelled while waiting for ['ghost']" in error, (took, error)
    assert p.exitcode == 0


def test_install_rejects_what_it_cannot_form():
    with pytest.raises(ValueError, match="gloo or nccl, not 'mpi'"):
        next_world._backend("mpi", None, 0, 1, timedelta(seconds=1), "0", [])
