"""torchrun's `dynatrain` rendezvous backend without torchrun: its parameters, token, rounds and exit barrier, and
the callback side of arrivals (ElasticCallback asks for every ready joiner; the launcher's callback stands down for
the user's). The whole path under real torchrun: tests/test_torchrun_backend.py."""

from __future__ import annotations

import signal
import socket
import threading

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from dynatrain.callbacks.rescale import ElasticCallback
from dynatrain.elastic.rendezvous import RDZV_ENV, launched_by_rendezvous
from dynatrain.elastic.rendezvous_handler import TERMINAL_BARRIER, DynaTrainRendezvousHandler
from dynatrain.vps.parallel_config import ParallelConfig
from tests._rescale_fakes import WaitingFakeStrategy, fake_trainer


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _params(endpoint: str, run_id: str = "job", min_nodes: int = 1, max_nodes: int = 3, **config):
    return RendezvousParameters("dynatrain", endpoint, run_id, min_nodes, max_nodes, **config)


@pytest.fixture
def clean_env(monkeypatch):
    """The handler hands its workers the job through the agent's environment: here that is pytest's own, which the
    processes later tests start inherit. Set, then removed, each is put back as it was (absent) after the test."""
    for name in ("DYNATRAIN_TOKEN", "DYNATRAIN_ENDPOINT", "DYNATRAIN_JOIN", "DYNATRAIN_ELASTIC", RDZV_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_torchrun_finds_the_backend_through_its_entry_point(clean_env):
    handler = get_rendezvous_handler(_params(f"127.0.0.1:{_port()}", last_call="0.5", timeout="30"))
    assert isinstance(handler, DynaTrainRendezvousHandler)
    assert handler.get_backend() == "dynatrain" and handler.last_call == 0.5 and not handler.use_agent_store


def test_bad_parameters_say_what_to_change(clean_env, tmp_path):
    with pytest.raises(ValueError, match="not a loopback address and the job has no token"):
        DynaTrainRendezvousHandler.from_parameters(_params("10.1.2.3:29400"))
    with pytest.raises(ValueError, match="unknown to the dynatrain backend"):
        DynaTrainRendezvousHandler.from_parameters(_params("127.0.0.1:29400", lastcall="1"))
    with pytest.raises(ValueError, match="cannot read it"):
        DynaTrainRendezvousHandler.from_parameters(_params("10.1.2.3:29400", token_file=str(tmp_path / "none")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        DynaTrainRendezvousHandler.from_parameters(_params("10.1.2.3:29400", token_file=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="--rdzv-endpoint"):
        DynaTrainRendezvousHandler.from_parameters(_params(""))
    (tmp_path / "token").write_text("T\n")
    handler = DynaTrainRendezvousHandler.from_parameters(_params("10.1.2.3:29400", token_file=str(tmp_path / "token")))
    assert handler.token == "T"  # a remote endpoint with the job's token is fine


def test_first_agents_start_the_job_a_later_one_joins_and_nothing_ever_restarts_the_workers(clean_env):
    endpoint = f"127.0.0.1:{_port()}"
    agents = [DynaTrainRendezvousHandler.from_parameters(_params(endpoint, min_nodes=2, last_call="0.2"))
              for _ in range(3)]
    infos: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: infos.__setitem__(i, agents[i].next_rendezvous()))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted((infos[i].rank, infos[i].world_size) for i in range(2)) == [(0, 2), (1, 2)]
    import os

    assert os.environ["DYNATRAIN_JOIN"] == "0" and os.environ[RDZV_ENV] == "dynatrain"
    late = agents[2].next_rendezvous()
    assert (late.rank, late.world_size) == (0, 1) and os.environ["DYNATRAIN_JOIN"] == "1"
    assert os.environ["DYNATRAIN_ENDPOINT"] == endpoint and os.environ["DYNATRAIN_TOKEN"]
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert all(a.num_nodes_waiting() == 0 for a in agents)
        assert signal.getsignal(signal.SIGTERM) == agents[2]._on_sigterm
    finally:
        signal.signal(signal.SIGTERM, previous)
    # A torchrun restart of a failed worker: the agent comes back as a joiner and checks out of its first round,
    # so the agent still in it does not wait for it at the end.
    again = agents[0].next_rendezvous()
    assert (again.rank, again.world_size) == (0, 1)
    first_round = infos[1].store
    assert first_round.add(TERMINAL_BARRIER + "/num_members", 0) == 1
    for a in agents:
        a.linger = 0.5
        a.shutdown()


def test_an_agent_without_the_job_s_token_or_with_another_run_id_is_refused(clean_env):
    endpoint = f"127.0.0.1:{_port()}"
    clean_env.setenv("DYNATRAIN_TOKEN", "right")
    host = DynaTrainRendezvousHandler.from_parameters(_params(endpoint, last_call="0"))
    host.next_rendezvous()
    clean_env.setenv("DYNATRAIN_TOKEN", "wrong")
    with pytest.raises(RendezvousConnectionError, match="refused the token"):
        DynaTrainRendezvousHandler.from_parameters(_params(endpoint, is_host="0")).next_rendezvous()
    clean_env.setenv("DYNATRAIN_TOKEN", "right")
    with pytest.raises(RendezvousConnectionError, match="serves the job 'job', not --rdzv-id 'other'"):
        DynaTrainRendezvousHandler.from_parameters(_params(endpoint, run_id="other", is_host="0")).next_rendezvous()
    host.linger = 0
    host.shutdown()


# ---------------------------------------------------------------------------------------------- the callback side
class PoolStrategy(WaitingFakeStrategy):
    def __init__(self, *args, ready: int = 0, **kw) -> None:
        super().__init__(*args, **kw)
        self.ready = ready
        self.switch_pending = False

    def ready_standby(self):
        return self.ready


def _check(cb, trainer, step):
    trainer.global_step = trainer.strategy.step = step
    cb.check(trainer, step)


def test_arrivals_are_asked_for_once_per_pool_and_a_leave_at_the_same_boundary_is_counted(clean_env, tmp_path):
    clean_env.setenv(RDZV_ENV, "dynatrain")
    assert launched_by_rendezvous()
    cb = ElasticCallback(log_dir=str(tmp_path), plan_ahead=False)
    assert cb.arrivals and cb.preemption == {}
    strategy = PoolStrategy("dp_shard=2", ready=0)
    trainer = fake_trainer(strategy, tmp_path)
    cb.setup(trainer, None, "fit")
    cb._trace = None
    _check(cb, trainer, 1)
    assert strategy.requests == []
    strategy.ready = 2
    _check(cb, trainer, 2)
    assert [(ParallelConfig.parse(t).world_size, leave) for t, leave in strategy.requests] == [(4, ())]
    assert cb.decisions[-1].source == "arrival"
    # The same pool on the same world is not asked for again (a refusal would be logged once, not at every step).
    strategy.world_size, strategy.requests = 2, []
    _check(cb, trainer, 3)
    assert strategy.requests == []
    # An arrival and a preemption agreed at one boundary: "the world and the arrivals" without the leaver.
    from dynatrain.signals.agreement import MergedRequest

    merged = MergedRequest(5, None, (1,), "arrival", "3 arrived", 0, 0.0, ("arrival", "preemption"))
    decision = cb._decide(trainer, merged, 4)
    assert decision.action == "switch", decision
    target, leave = strategy.requests[-1]
    assert ParallelConfig.parse(target).world_size == 4 and leave == (1,)


def test_the_launcher_s_callback_stands_down_for_the_user_s(clean_env, tmp_path):
    clean_env.setenv(RDZV_ENV, "dynatrain")
    from dynatrain.callbacks.launched import launcher_callbacks

    [auto] = launcher_callbacks()
    user = ElasticCallback(log_dir=str(tmp_path))
    trainer = fake_trainer(PoolStrategy("dp_shard=2"), tmp_path)
    trainer.callbacks.extend([user, auto])
    assert auto._inert(trainer) and not user._inert(trainer)
    clean_env.delenv(RDZV_ENV)
    assert launcher_callbacks() == []
    assert not ElasticCallback().arrivals and ElasticCallback().preemption is None

