"""The agent's side of torchrun's ``dynatrain`` rendezvous backend (`dynatrain.elastic.rendezvous` says what it does).

This module imports torch only: torchrun loads it in its agent, which never imports Lightning.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.utils.store import _barrier_nonblocking

from dynatrain.elastic.store import check_token, parse_endpoint, serve_in_process
from dynatrain.runtime.addresses import is_loopback
from dynatrain.settings import ELASTIC_ENV, ENDPOINT_ENV, JOIN_ENV, RDZV_ENV, TOKEN_ENV, explicit_or_env
from dynatrain.settings import RDZV_BACKEND as BACKEND

LOGGER = logging.getLogger("dynatrain.elastic")
# torchrun's agents wait here for one another when their workers are done (`SimpleElasticAgent._exit_barrier`).
TERMINAL_BARRIER = "torchelastic/agent/terminal_state"
CONFIG_KEYS = {"token_file", "last_call", "timeout", "is_host", "linger"}


def _is_this_host(host: str) -> bool:
    if is_loopback(host):
        return True
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return _matches_machine_hostname(host)


def resolve_token(token_file: str | None) -> str | None:
    """The job's token: ``$DYNATRAIN_TOKEN``, else the first line of ``token_file``; None when neither gives one."""
    token = explicit_or_env(None, TOKEN_ENV)
    if token or not token_file:
        return token
    try:
        token = Path(token_file).read_text().strip()
    except OSError as e:
        raise ValueError(f"--rdzv-conf token_file={token_file}: cannot read it ({e.strerror}); give a file "
                         "that holds the job's token, or set $DYNATRAIN_TOKEN") from None
    if not token:
        raise ValueError(f"--rdzv-conf token_file={token_file} is empty: write the job's token into it")
    return token


class DynaTrainRendezvousHandler(RendezvousHandler):
    """One agent's side of the rendezvous (see the module's docstring)."""

    def __init__(self, endpoint: str, run_id: str, min_nodes: int, max_nodes: int, token: str | None,
                 last_call: float = 1.0, timeout: float = 600.0, is_host: bool | None = None,
                 local_addr: str | None = None, linger: float = 30.0) -> None:
        if not endpoint:
            raise ValueError("--rdzv-backend dynatrain needs --rdzv-endpoint HOST:PORT: the address of the job's "
                             "store, served by the agent on that host")
        self.host, self.port = parse_endpoint(endpoint)
        if self.port == 0:
            raise ValueError(f"--rdzv-endpoint {endpoint}: give a fixed port that every agent can reach")
        if token is None:
            if not is_loopback(self.host):
                raise ValueError(
                    f"--rdzv-endpoint {endpoint} is not a loopback address and the job has no token: set "
                    "$DYNATRAIN_TOKEN or pass --rdzv-conf token_file=PATH on every agent (without a token any "
                    "process that reaches the port could join the job)")
            token = f"loopback:{run_id}"
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"--nnodes {min_nodes}:{max_nodes}: give 1 <= MIN <= MAX")
        if not last_call >= 0 or not timeout > 0:
            raise ValueError(f"--rdzv-conf last_call={last_call} must be >= 0 and timeout={timeout} > 0 seconds")
        self.endpoint = f"{self.host}:{self.port}"
        self.run_id, self.min_nodes, self.max_nodes = run_id, min_nodes, max_nodes
        self.token, self.last_call, self.timeout = token, last_call, timeout
        self.is_host, self.local_addr = is_host, local_addr
        self._store = None
        self._round: tuple[object, int] | None = None  # (the round's store, its agents): for the exit barrier
        self._leaving = False
        self._closed = False
        # This agent's arrival numbers, one per round it entered: a second round is torchrun restarting its failed
        # workers, which rejoin.
        self._seqs: list[int] = []
        self._serving = False
        self.linger = linger

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> "DynaTrainRendezvousHandler":
        unknown = set(params.config) - CONFIG_KEYS
        if unknown:
            raise ValueError(f"--rdzv-conf {', '.join(sorted(unknown))}: unknown to the dynatrain backend; it takes "
                             f"{', '.join(sorted(CONFIG_KEYS))}")
        return cls(params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
                   resolve_token(params.get("token_file")), float(params.get("last_call", 1.0)),
                   float(params.get("timeout", 600.0)), params.get_as_bool("is_host"), params.local_addr,
                   float(params.get("linger", 30.0)))

    # ---- torchrun's interface ------------------------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False  # workers form their groups through dynatrain's store, not the agent's round store

    def get_run_id(self) -> str:
        return self.run_id

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        """Always 0: an arriving node joins the running workers, so torchrun never restarts them for it. torchrun
        asks this on its main thread while the workers are healthy, after it installed its own SIGTERM handler:
        the moment to put ours in its place."""
        if signal.getsignal(signal.SIGTERM) != self._on_sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        return 0

    def shutdown(self) -> bool:
        """The agent is done with the job. A leaving agent checks out of its round, so that the agents still in it do
        not wait for it when their own workers finish. The rendezvous stays open for the others. The agent that
        serves the store keeps it until every other agent is done (at most ``linger`` seconds): an agent whose
        workers still wait to join learns from it that the job ended."""
        if self._leaving:
            self._check_out()
        store = self._store
        if store is None:
            return True
        try:
            for seq in self._seqs:
                store.set(f"rdzv/done/{seq}", "1")
            if self._serving:
                deadline = time.monotonic() + self.linger
                arrived = store.add("rdzv/arrivals", 0)
                while time.monotonic() < deadline and \
                        not all(store.check([f"rdzv/done/{n}"]) for n in range(1, arrived + 1)):
                    time.sleep(0.1)
        except RuntimeError:
            pass  # the store is gone: nobody is left to tell
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._closed:
            raise RendezvousClosedError()
        store = self._connect()
        self._check_out()  # a restart after a failure: this agent's earlier round does not wait for it
        seq = store.add("rdzv/arrivals", 1)
        self._seqs.append(seq)
        first = self._first_round_size(store)
        if seq <= first and len(self._seqs) == 1:
            round_store, rank, size = dist.PrefixStore("rdzv/round/first", store), seq - 1, first
            join = False
        else:
            round_store, rank, size = dist.PrefixStore(f"rdzv/round/late{seq}", store), 0, 1
            join = True
        self._round = (round_store, size)
        self._export(join)
        LOGGER.info("dynatrain rendezvous: agent %d of the job %s %s", seq, self.run_id,
                    "joins the running job" if join else f"starts it as node {rank} of {size}")
        bootstrap = RendezvousStoreInfo.build(rank, round_store, self.local_addr)
        return RendezvousInfo(round_store, rank, size, bootstrap)

    # ---- the job's store ------------------------------------------------------------------------------------
    def _connect(self):
        if self._store is not None:
            return self._store
        host_here = self.is_host if self.is_host is not None else _is_this_host(self.host)
        store = None
        if host_here:
            try:
                store = serve_in_process(self.host, self.port, self.token, self.timeout)
                store.set("rdzv/run_id", self.run_id)
                self._serving = True
                LOGGER.info("dynatrain rendezvous: this agent serves the job's store at %s", self.endpoint)
            except (RuntimeError, OSError, ValueError):
                store = None  # another agent on this host serves it: be a client, as torchrun's c10d backend is
        if store is None:
            store = self._client()
        self._store = store
        return store

    def _client(self):
        try:
            store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout))
        except (RuntimeError, OSError) as e:
            raise RendezvousConnectionError(
                f"no store answers at {self.endpoint} within {self.timeout:.0f}s: the agent on that host serves it; "
                f"start it there first, or check the address ({e})") from None
        try:
            check_token(store, self.endpoint, self.token,
                        "give every agent the job's token ($DYNATRAIN_TOKEN or --rdzv-conf token_file=PATH)")
        except (PermissionError, ConnectionError) as e:
            raise RendezvousConnectionError(str(e)) from None
        job = store.get("rdzv/run_id").decode()
        if job != self.run_id:
            raise RendezvousConnectionError(f"the store at {self.endpoint} serves the job {job!r}, not "
                                            f"--rdzv-id {self.run_id!r}: give every agent the same --rdzv-id")
        return store

    def _first_round_size(self, store) -> int:
        """How many agents start the job: fixed once by whichever agent closes the first round (compare-and-set),
        after at least MIN arrived and ``last_call`` seconds passed (or MAX arrived)."""
        closed = "rdzv/first_round"
        deadline = time.monotonic() + self.timeout
        last_call: float | None = None
        while not store.check([closed]):
            arrived = store.add("rdzv/arrivals", 0)
            now = time.monotonic()
            if arrived >= self.min_nodes and last_call is None:
                last_call = now + self.last_call
            if arrived >= self.max_nodes or (last_call is not None and now >= last_call):
                store.compare_set(closed, "", str(min(arrived, self.max_nodes)))
                break
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"only {arrived} of at least {self.min_nodes} agents arrived at {self.endpoint} within "
                    f"{self.timeout:.0f}s (--rdzv-conf timeout=SECONDS waits longer)")
            time.sleep(0.05)
        return int(store.get(closed).decode())

    def _export(self, join: bool) -> None:
        """What the workers need, in the agent's environment, which torchrun copies into each of them."""
        os.environ.update({
            ENDPOINT_ENV: self.endpoint, TOKEN_ENV: self.token, JOIN_ENV: "1" if join else "0", RDZV_ENV: BACKEND,
        })
        os.environ.setdefault(ELASTIC_ENV, json.dumps({}))  # a strategy left at elastic=None is elastic

    # ---- leaving ----------------------------------------------------------------------------------------------
    def _check_out(self) -> None:
        if self._round is None:
            return
        round_store, size = self._round
        self._round = None
        try:
            _barrier_nonblocking(round_store, size, TERMINAL_BARRIER)
        except Exception as e:  # the store may be gone with the job: nothing waits for this agent then
            LOGGER.debug("checking out of the round failed: %s", e)

    def _on_sigterm(self, signum, frame) -> None:
        """Leave the job, not fail it: torchrun's clean-up then sends SIGTERM on to the workers (each leaves at the
        next step boundary, an online scale-in) and waits up to ``--shutdown-timeout`` for them; the agent exits 0."""
        LOGGER.warning("dynatrain rendezvous: SIGTERM: this node's workers leave the job at the next step boundary")
        self._leaving = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the workers' exit short
        raise SystemExit(0)
