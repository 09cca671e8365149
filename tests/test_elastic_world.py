"""World generations over a long-lived store: members leave (rank 0 included), brand-new processes join."""

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _launch import python_path
from dynatrain.elastic import store as store_mod
from dynatrain.elastic.registry import RegistrationError, register, registered, set_job_info
from dynatrain.elastic.world import WorldChange, default_backend, plan_union_then_target

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "world_worker.py"
TOKEN = secrets.token_hex(8)


@pytest.fixture(scope="module")
def job_store(tmp_path_factory):
    handle = store_mod.start_store(TOKEN, tmp_path_factory.mktemp("store"), timeout=60)
    yield handle
    assert handle.proc.poll() is None, "the store must outlive every training process"
    handle.stop()
    assert handle.proc.returncode == 0


def _spawn(endpoint: str, tmp: Path, mid: str, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    out, log = tmp / f"{mid}.json", tmp / f"{mid}.log"
    env = dict(os.environ, PYTHONPATH=python_path(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               DYNATRAIN_STORE_TOKEN=TOKEN)
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(WORKER), "--endpoint", endpoint, "--id", mid, "--out", str(out),
                                 *extra], env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out, log


def _wait(procs: dict, timeout: float) -> dict:
    """Wait for every process to exit 0; on a failure kill the rest and show every log."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p, _, _ in procs.values()):
            failed = [m for m, (p, _, _) in procs.items() if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                time.sleep(1.0)
                logs = "\n".join(f"--- {m}\n{log.read_text()[-2000:]}" for m, (_, _, log) in procs.items())
                raise AssertionError(f"failed: {failed or 'timeout'}\n{logs}")
            time.sleep(0.1)
        failed = [m for m, (p, _, _) in procs.items() if p.returncode != 0]
        assert not failed, "\n".join(f"--- {m}\n{procs[m][2].read_text()[-2000:]}" for m in failed)
    finally:
        for p, _, _ in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return {m: json.loads(out.read_text()) for m, (_, out, _) in procs.items()}


def test_a_world_formed_on_a_gpu_host_still_takes_cpu_tensors(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert default_backend() == "gloo"
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert default_backend() == "cpu:gloo,cuda:nccl"  # NCCL alone refuses CPU tensors


def test_union_then_target_plans():
    assert plan_union_then_target(4, ["b", "a"], ["a", "b", "c"]).steps == [("a", "b", "c")]  # scale-out
    assert plan_union_then_target(4, ["a", "b", "c"], ["c"]).steps == [("c",)]  # scale-in, transfer on gen 4
    mixed = plan_union_then_target(4, ["a", "b"], ["b", "c"])
    assert mixed.generation == 5 and mixed.steps == [("a", "b", "c"), ("b", "c")]
    assert plan_union_then_target(4, ["a"], ["a"]).steps == []
    # A target rank order: when nobody leaves, one generation ranked that way; otherwise the sorted union
    # moves the state and the target is formed in that order.
    assert plan_union_then_target(4, ["a", "b"], ["a", "b", "c"], order=["a", "c", "b"]).steps == [("a", "c", "b")]
    assert plan_union_then_target(4, ["a", "b"], ["b", "c"], order=["c", "b"]).steps == [("a", "b", "c"), ("c", "b")]
    assert plan_union_then_target(4, ["a", "b"], ["a", "b"], order=["b", "a"]).steps == [("b", "a")]
    t = plan_union_then_target(4, ["a", "b"], ["b", "c"], order=["c", "b"])
    assert WorldChange.from_json(t.to_json()) == t
    with pytest.raises(ValueError, match="not an arrangement of the new members"):
        plan_union_then_target(4, ["a"], ["a", "b"], order=["a", "c"])


def test_wrong_token_and_bad_endpoint_are_refused(job_store):
    with pytest.raises(PermissionError, match="refused the token"):
        store_mod.connect(job_store.endpoint, "not-" + TOKEN, timeout=10)
    with pytest.raises(ValueError, match="HOST:PORT"):
        store_mod.connect("localhost", TOKEN)
    store_mod.connect(job_store.endpoint, TOKEN, timeout=10)


def test_mismatched_model_config_is_refused_at_registration(job_store):
    store = store_mod.connect(job_store.endpoint, TOKEN, timeout=10)
    set_job_info(store, {"model_config_hash": "cfg-a", "code_version": "test"})
    with pytest.raises(RegistrationError, match="model_config_hash: job has 'cfg-a', this process has 'cfg-b'"):
        register(store, "intruder", {"model_config_hash": "cfg-b", "code_version": "test"})
    assert "intruder" not in registered(store)


def test_a_managers_store_and_join_come_from_its_config_before_what_a_launcher_carried(job_store, monkeypatch):
    from dynatrain.elastic.manager import ElasticConfig, ElasticManager
    from dynatrain.settings import ENDPOINT_ENV, JOIN_ENV, TOKEN_ENV

    monkeypatch.setenv(ENDPOINT_ENV, "127.0.0.1:1")  # nothing listens there: used, it would fail
    monkeypatch.setenv(TOKEN_ENV, "not-" + TOKEN)
    monkeypatch.setenv(JOIN_ENV, "1")
    mine = ElasticManager(ElasticConfig(endpoint=job_store.endpoint, token=TOKEN, join=False, timeout=10))
    assert (mine.endpoint, mine.token, mine.joining) == (job_store.endpoint, TOKEN, False)
    assert ElasticManager(ElasticConfig(endpoint=job_store.endpoint, token=TOKEN, timeout=10)).joining  # carried
    monkeypatch.setenv(ENDPOINT_ENV, job_store.endpoint)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.delenv(JOIN_ENV)
    carried = ElasticManager(ElasticConfig(join=True, timeout=10))
    assert (carried.endpoint, carried.joining, carried.config.join) == (job_store.endpoint, True, True)
    assert not ElasticManager(ElasticConfig(timeout=10)).joining


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_members_leave_then_new_processes_join(job_store, tmp_path):
    ep = job_store.endpoint
    initial = {m: _spawn(ep, tmp_path, m) for m in ["p0", "p1", "p2", "p3"]}
    # The joiners are started only once p0 and p1 are gone: a later world is built of new processes.
    deadline = time.monotonic() + 60
    while any(initial[m][0].poll() is None for m in ["p0", "p1"]):
        assert time.monotonic() < deadline and not any(p.poll() for p, _, _ in initial.values()), \
            "\n".join(log.read_text()[-1500:] for _, _, log in initial.values())
        time.sleep(0.1)
    joiners = {m: _spawn(ep, tmp_path, m, "--role", "joiner") for m in ["j4", "j5"]}
    ev = _wait({**initial, **joiners}, timeout=90)

    def sums(m):
        return [(e["gen"], e["rank"], e["world"], e["sum"], e.get("transfer", False)) for e in ev[m] if "gen" in e]

    # gen 0: ids 0+1+2+3; gen 1: p2 is the new rank 0; gen 2 spans old and new; gen 3 is the target
    assert sums("p0") == [(0, 0, 4, 6.0, False)]
    assert sums("p1") == [(0, 1, 4, 6.0, False)]
    assert sums("p2") == [(0, 2, 4, 6.0, False), (1, 0, 2, 5.0, False), (2, 2, 4, 14.0, True)]
    assert sums("p3") == [(0, 3, 4, 6.0, False), (1, 1, 2, 5.0, False), (2, 3, 4, 14.0, True),
                          (3, 2, 3, 12.0, False)]
    assert sums("j4") == [(2, 0, 4, 14.0, True), (3, 0, 3, 12.0, False)]
    assert sums("j5") == [(2, 1, 4, 14.0, True), (3, 1, 3, 12.0, False)]
    for m in ev:
        for e in ev[m]:
            if "gen" in e:
                assert (e["backend_rank"], e["backend_world"]) == (e["rank"], e["world"])
                assert e["count"] == e["world"]
    # Leavers deregistered before survivors looked, so only the two new processes were pending.
    assert [e["pending_seen"] for e in ev["p2"] if "pending_seen" in e] == [["j4", "j5"]]
    store = store_mod.connect(ep, TOKEN, timeout=10)
    assert set(registered(store)) >= {"p3", "j4", "j5"} and not {"p0", "p1", "p2"} & set(registered(store))


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_member_that_never_arrives_times_out_clearly(job_store, tmp_path):
    args = ["--role", "ghost", "--generation", "100", "--timeout", "4", "--members", "g0", "g1"]
    ev = _wait({m: _spawn(job_store.endpoint, tmp_path, m, *args) for m in ["g0", "g1"]}, timeout=45)
    for m in ["g0", "g1"]:
        (e,) = ev[m]
        assert e["error"] == "TimeoutError"
        assert "member(s) ['ghost'] did not arrive within 4.0s" in e["message"]
        assert "form generation 101" in e["message"]
        assert 3.5 < e["elapsed"] < 8.0


@pytest.mark.timeout(60)
def test_store_exits_when_its_launcher_dies(tmp_path):
    ep_file = tmp_path / "endpoint"
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         f"p = subprocess.Popen([sys.executable, {str(store_mod.__file__)!r}, '--port', '0', '--token', 't', "
         f"'--endpoint-file', {str(ep_file)!r}], stdout=subprocess.DEVNULL)\n"
         "print(p.pid, flush=True)\n"
         "time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        store_pid = int(launcher.stdout.readline())
        deadline = time.monotonic() + 40
        while not ep_file.exists():
            assert time.monotonic() < deadline, "the store never served"
            time.sleep(0.1)
        store_mod.connect(ep_file.read_text().strip(), "t", timeout=10)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while store_mod._alive(store_pid):
            assert time.monotonic() < deadline, "the store outlived its launcher"
            time.sleep(0.1)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        try:
            os.kill(store_pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_a_new_generation_gets_tensors_on_its_own_mesh(tmp_path):
    """DTensor caches sharding by mesh shape: without forgetting them at a world change, an op on the new
    generation's mesh hands back a tensor on the old generation's mesh (stale rank, dead groups)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dynatrain.strategies.mesh_cache import forget_old_meshes

    def generation(i: int, forget: bool) -> bool:
        if forget:
            forget_old_meshes()
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / f"gen{i}"), 1), rank=0, world_size=1)
        try:
            mesh = DeviceMesh("cpu", [0])
            out = torch.empty_like(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
            return out.device_mesh is mesh
        finally:
            dist.destroy_process_group()

    assert generation(0, forget=True)
    assert generation(1, forget=True)  # on torch 2.13 this fails without forget_old_meshes()
