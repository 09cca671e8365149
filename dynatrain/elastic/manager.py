"""The elastic device manager of one process: its store connection, its member id and its world generation.

Training processes that start together form generation 0 with member ids ``000000-<rank>``. A process that
joins later takes the next number of the store's joiner counter (``000001-...``), so ids sort in arrival order
and the members that stay keep the lowest ranks (rank 0 changes only when rank 0 leaves).

A joiner registers (the job refuses another model or code version), gets ready, and waits; current members see
it through :meth:`ready_joiners` and admit it in a world change. Everything a joiner needs to run the same
switch as the current members (the old layout, the plan's inputs and the training-loop state) is written to
the store under ``elastic/switch/<generation>`` before the world change is announced.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from dynatrain.elastic import priority
from dynatrain.elastic.store import connect
from dynatrain.elastic.registry import deregister, pending_joiners, processes_on_host, ready_key, register
from dynatrain.elastic.world import (
    NextGeneration,
    WorldChange,
    WorldGeneration,
    await_admission,
    default_backend,
    union_then_target,
)
from dynatrain.runtime.threads import host_name, resplit, splits_threads
from dynatrain.settings import ELASTIC_ENV, ENDPOINT_ENV, JOIN_ENV, REJOIN_ENV, TOKEN_ENV, explicit_or_env

# What a launcher carries to the processes it starts, read as the defaults of `ElasticConfig` (dynatrain.settings):
JOIN_CHECKPOINT = "dynatrain://join"  # the ckpt_path a joiner's Trainer resumes from: loop state over the store
# Every member waits at the rendezvous for the last admitted joiner to notice: poll often (one small store request).
ADMISSION_POLL = 0.01
FINISHED_KEY = "elastic/finished"


PAYLOAD_POLL = 0.002  # the members wait in their stall for a joiner that formed their next world to read it


class JobEnded(RuntimeError):
    """A joiner's job ended before it was admitted: there is nothing to join, and nothing failed."""


@dataclass
class ElasticConfig:
    """How a job changes its world.

    Args:
        max_devices: the most processes the job may grow to (None: no limit).
        join_timeout: seconds a scale-out waits for enough ready joiners before it is dropped with a warning.
        timeout: seconds to form a generation and for its collectives; a member that vanishes surfaces as a
            clear error within it instead of a hang.
        recover: when a process dies while the job trains, re-form the world on the survivors and rebuild the
            state from replicas in memory (needs every lost shard on a survivor, e.g. ``dp_replicate >= 2``).
        heartbeat: seconds between a process's liveness beats in the store; a member whose beats stopped for
            ``5 * heartbeat`` counts as lost after a fault.
        recovery_wait: the longest survivors of a fault wait for a member that still beats but has not reported
            (it may be blocked in a collective until ``timeout``); default ``timeout + 10``.
        endpoint, token: the job's store (default: ``$DYNATRAIN_ENDPOINT``, ``$DYNATRAIN_TOKEN``).
        join: this process joins the running job (registers, gets ready and waits for a scale-out to admit it)
            instead of starting it with the others. None (the default): ``$DYNATRAIN_JOIN=1`` says so, as
            `dynatrain join` and the launchers' joiners set it; leave it None in a recipe that members and joiners
            share.
        rejoin: a process of `dynatrain fit` or `dynatrain join` that leaves the job starts over as a standby
            (`dynatrain join`) instead of exiting. None: ``$DYNATRAIN_REJOIN=1``, as the launcher sets it with
            ``--elastic.standby``.
        split_threads: after every world change in a CPU world, set this process's intra-op threads to its share
            of its host's cores (`dynatrain.runtime.threads`). None: only when a launcher of dynatrain's chose the count
            (``$DYNATRAIN_THREADS=split``, for a process started without ``OMP_NUM_THREADS``).
        standby_nice: how much a joiner raises its niceness from registering until it is admitted, so that a
            standby process getting ready and waiting takes a smaller share of the members' cores; it gets its normal
            priority back before it enters the world (`dynatrain.elastic.priority`). 0: joiners keep their
            priority. Where the system would not let it lower its niceness again (RLIMIT_NICE), it is not raised.

    An explicit value always wins over the environment, which only carries a launcher's values to the processes it
    starts (`dynatrain.settings`); `resolved` applies that precedence.
    """

    max_devices: int | None = None
    join_timeout: float = 300.0
    timeout: float = 120.0
    recover: bool = True
    heartbeat: float = 0.5
    recovery_wait: float | None = None
    endpoint: str | None = None
    token: str | None = None
    join: bool | None = None
    rejoin: bool | None = None
    split_threads: bool | None = None
    standby_nice: int = priority.DEFAULT_STANDBY_NICE

    def __post_init__(self) -> None:
        priority.check_amount(self.standby_nice, "elastic standby_nice")
        if self.max_devices is not None and self.max_devices < 1:
            raise ValueError(f"elastic max_devices must be at least 1, got {self.max_devices}")
        if self.recovery_wait is None:
            self.recovery_wait = self.timeout + 10.0
        for name in ("join_timeout", "timeout", "heartbeat", "recovery_wait"):
            if not getattr(self, name) > 0:
                raise ValueError(f"elastic {name} must be positive seconds, got {getattr(self, name)}")

    @classmethod
    def parse(cls, value: "ElasticConfig | dict | bool | None") -> "ElasticConfig | None":
        """A strategy's ``elastic=``: None (not given) takes ``$DYNATRAIN_ELASTIC``, the JSON config a launcher
        (`dynatrain fit --elastic.*`) gives the processes it starts, and is not elastic without it; any explicit
        value (False included) wins over it whole, fields the launcher set but the value lacks included."""
        value = explicit_or_env(value, ELASTIC_ENV, json.loads)
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown elastic option(s) {sorted(unknown)}; known: "
                                 f"{sorted(cls.__dataclass_fields__)}")
            return cls(**value)
        raise TypeError(f"elastic= takes True, a dict of ElasticConfig fields or an ElasticConfig, got {value!r}")

    def resolved(self) -> "ElasticConfig":
        """This config with each field left None that a launcher may carry filled from the environment: a value
        given explicitly wins (`dynatrain.settings.explicit_or_env`). ``split_threads`` stays as it is: the
        environment's mark is read at every world change (`threads.splits_threads`)."""
        from dataclasses import replace

        return replace(
            self,
            endpoint=explicit_or_env(self.endpoint or None, ENDPOINT_ENV),
            token=explicit_or_env(self.token or None, TOKEN_ENV),
            join=bool(explicit_or_env(self.join, JOIN_ENV, lambda v: v == "1")),
            rejoin=bool(explicit_or_env(self.rejoin, REJOIN_ENV, lambda v: v == "1")),
        )


def initial_member(rank: int) -> str:
    return f"000000-{rank:06d}"


class ElasticManager:
    def __init__(self, config: ElasticConfig, backend: str | None = None) -> None:
        """``backend``: of every generation's process group; by default NCCL where CUDA is visible, else gloo. A
        strategy passes its own (Lightning's choice for its device), so CPU ranks on a GPU host form gloo groups."""
        self.config = config = config.resolved()  # explicit fields, else what the launcher carried
        self.backend = backend
        endpoint, token = config.endpoint, config.token
        if not endpoint or not token:
            raise ValueError(
                "elastic training needs the job's store: start it with `dynatrain fit --elastic.max_devices N ...` "
                f"(which starts one), or set ${ENDPOINT_ENV} and ${TOKEN_ENV} as a launcher does"
            )
        self.endpoint, self.token = endpoint, token
        self.store = connect(endpoint, token, timeout=config.timeout)
        self.world: WorldGeneration | None = None
        self.member_id: str | None = None
        self.joining = bool(config.join)
        self._beating: threading.Event | None = None
        self._joiner_beats: dict[str, tuple[int, float]] = {}  # joiner -> (last beat count, when it changed)
        self.thread_splits: list[tuple[int, int]] = []  # per world this process entered: (processes on host, threads)

    def end_at_exit(self) -> None:
        """End this process's world when the interpreter exits, if nobody did before: a script of the user's (under
        torchrun) ends after `fit` with the world's groups and the model's DTensors alive, and gloo's threads torn
        down by the interpreter's own clean-up abort the process now and then ("terminate called without an active
        exception") after training succeeded. Collected first, then destroyed; no barrier, which a peer that
        already failed would hold up until the timeout."""
        def end() -> None:
            import gc

            import torch.distributed as dist

            gc.collect()
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()

        atexit.register(end)

    def _start_heartbeat(self) -> None:
        """Beat in the store from a thread with its own connection, so a process blocked in a collective still
        shows it is alive, and one that died stops beating."""
        if self._beating is not None:
            return
        self._beating = stop = threading.Event()
        store = self.new_connection()
        key, period = f"elastic/alive/{self.member_id}", self.config.heartbeat

        def beat() -> None:
            while not stop.wait(period):
                try:
                    store.add(key, 1)
                except RuntimeError:
                    return  # the store is gone: the job is over

        store.add(key, 1)
        thread = threading.Thread(target=beat, name="dynatrain-heartbeat", daemon=True)
        thread.start()

        def stop_at_exit() -> None:
            # A daemon thread still inside the store's C++ client when the interpreter ends aborts the process
            # ("terminate called without an active exception"): end it first.
            stop.set()
            thread.join(timeout=5)

        atexit.register(stop_at_exit)

    def stop_heartbeat(self) -> None:
        if self._beating is not None:
            self._beating.set()

    # ---- membership ---------------------------------------------------------------------------------------
    def start(self, rank: int, world_size: int, info: dict) -> WorldGeneration:
        """Form generation 0 with the processes the job started with."""
        self.member_id = initial_member(rank)
        register(self.store, self.member_id, info)
        self._start_heartbeat()
        members = [initial_member(r) for r in range(world_size)]
        self.world = WorldGeneration.join(self.store, 0, self.member_id, members, self.config.timeout, self.backend)
        self.split_threads()
        return self.world

    def register_joiner(self, info: dict) -> str:
        """Register this process as a joiner (refused when its model or code differ from the job's)."""
        # It gets ready and waits at low priority until admitted (`dynatrain join` has run so from its start;
        # here the config's own value applies).
        priority.lower(self.config.standby_nice)
        n = self.store.add("elastic/joiner_seq", 1)
        self.member_id = f"{n:06d}-{os.getpid()}"
        register(self.store, self.member_id, info)
        self._start_heartbeat()
        return self.member_id

    def mark_ready(self) -> None:
        self.store.set(ready_key(self.member_id), str(time.time()))

    def ready_joiners(self) -> list[str]:
        """Registered joiners that said they are ready and still beat, in arrival order. A joiner whose beats
        stopped for ``5 * heartbeat`` (it died or hangs) is dropped instead of being admitted."""
        assert self.world is not None
        out = []
        for m in sorted(pending_joiners(self.store, self.world.members)):
            silent = self.silent_for(m)
            if silent is not None:
                self.drop_joiner(m, f"it stopped beating for {silent:.1f}s (the process died or hangs)")
                continue
            if self.store.check([ready_key(m)]):
                out.append(m)
        return out

    def silent_for(self, member_id: str) -> float | None:
        """Seconds since ``member_id``'s beats stopped, once over ``5 * heartbeat`` (it died or hangs); else None.
        Called at each boundary by rank 0 for the joiners it waits on."""
        now = time.monotonic()
        count = self.store.add(f"elastic/alive/{member_id}", 0)
        seen = self._joiner_beats.get(member_id)
        if seen is None or seen[0] != count:
            self._joiner_beats[member_id] = (count, now)
            return None
        return now - seen[1] if now - seen[1] > 5 * self.config.heartbeat else None

    def drop_joiner(self, member_id: str, reason: str) -> None:
        self.store.set(f"elastic/dropped/{member_id}", reason)
        self.store.set(f"registry/left/{member_id}", "1")

    # ---- a world change -----------------------------------------------------------------------------------
    def publish(self, generation: int, payload: dict) -> None:
        """What joiners need to run the switch; written before the world change is announced."""
        self.store.set(f"elastic/switch/{generation}", json.dumps(payload))

    def change_world(self, new_members: list[str], transfer, order: list[str] | None = None,
                     ahead: NextGeneration | bool = False) -> WorldGeneration | None:
        """Every current member: union, ``transfer`` on it, then the target (ranked by ``order`` when given).
        ``ahead``: the target was formed in the background (`form_ahead` on its members, True on one that leaves).
        None on a member that left."""
        assert self.world is not None
        self.world = union_then_target(self.world, new_members, transfer, timeout=self.config.timeout, order=order,
                                       ahead=ahead)
        self.split_threads(ahead.host_processes if isinstance(ahead, NextGeneration) else None)
        return self.world

    def new_connection(self):
        """A connection of its own to the job's store, for a thread (a connection serves one thread)."""
        return connect(self.endpoint, self.token, timeout=self.config.timeout)

    def form_ahead(self, members: list[str], subgroups=()) -> NextGeneration:
        """Start forming the next generation of ``members`` (in rank order, this process one of them), and its
        ``subgroups``, on a background thread with its own store connection, while the current one trains."""
        assert self.world is not None
        return self.world.form_ahead(self.new_connection, members, subgroups=subgroups)

    def agree_on_survivors(self, info: dict) -> dict[str, dict]:
        """After a fault: which members of the current generation are still there, each with its ``info``.

        Every survivor reports under the generation's key and waits until each other member has reported or
        stopped beating (at most ``recovery_wait``: a live member may be blocked in a collective until the
        group's timeout). The first to stop waiting fixes the list (compare-and-set), so every survivor gets
        the same one; a member that reports after that is not in it and must stop.
        """
        assert self.world is not None
        key = f"recover/{self.world.generation}"
        self.store.set(f"{key}/info/{self.member_id}", json.dumps(info))
        members = list(self.world.members)
        stale_after = 5 * self.config.heartbeat
        now = time.monotonic()
        deadline = now + self.config.recovery_wait
        beats = {m: (self.store.add(f"elastic/alive/{m}", 0), now) for m in members}
        while True:
            missing = [m for m in members if not self.store.check([f"{key}/info/{m}"])]
            now = time.monotonic()
            for m in missing:
                count = self.store.add(f"elastic/alive/{m}", 0)
                if count != beats[m][0]:
                    beats[m] = (count, now)
            if all(now - beats[m][1] > stale_after for m in missing) or now > deadline:
                break
            time.sleep(0.05)
        here = [m for m in members if self.store.check([f"{key}/info/{m}"])]
        agreed = json.loads(self.store.compare_set(f"{key}/members", "", json.dumps(here)).decode())
        if self.member_id not in agreed:
            raise TimeoutError(f"member {self.member_id} reported after the survivors {agreed} of generation "
                               f"{self.world.generation} were agreed (recovery_wait={self.config.recovery_wait}s)")
        for m in members:
            if m not in agreed:
                deregister(self.store, m)  # never mistaken for a joiner later
        return {m: json.loads(self.store.get(f"{key}/info/{m}").decode()) for m in agreed}

    def reform(self, members: list[str]) -> WorldGeneration:
        """The survivors' generation, after the broken one was left."""
        assert self.world is not None
        self.world = WorldGeneration.join(self.store, self.world.generation + 1, self.member_id, members,
                                          self.config.timeout, self.backend)
        self.split_threads()
        return self.world

    def await_admission(self, on_wait: Callable[[float], None] | None = None) -> tuple[WorldChange, dict]:
        """A joiner: block until admitted (or dropped); return the world change and the switch payload.
        ``on_wait(monotonic time)`` runs between polls (a joiner prepares its plan there). Admitted, it has its
        normal priority back before it enters the world."""
        try:
            self._poll_for(f"admit/{self.member_id}", self.config.join_timeout, ADMISSION_POLL, on_wait,
                           ended=f"joiner {self.member_id}: the job finished before admitting it",
                           late=f"joiner {self.member_id} was not admitted within {self.config.join_timeout:.0f}s: no "
                                "scale-out of the job asked for it")
        finally:
            priority.restore()
        t = await_admission(self.store, self.member_id, timeout=self.config.timeout)
        if t.key is not None:
            return t, None  # the world forms first, with the members, while they train; the payload comes after
        return t, json.loads(self.store.get(f"elastic/switch/{t.generation}").decode())

    def await_payload(self, t: WorldChange, on_wait: Callable[[float], None] | None = None) -> dict:
        """A joiner admitted to a change formed ahead, in its world already: the payload rank 0 publishes at the
        switch's boundary (a TimeoutError if the members dropped the change instead). ``on_wait``: as for
        `await_admission`; a joiner is admitted to a formation as soon as it is ready, often before rank 0 has
        published the change's intent, so it prepares here what it could not before."""
        key = f"elastic/switch/{t.generation}"
        self._poll_for(key, self.config.timeout, PAYLOAD_POLL, on_wait,
                       ended=f"joiner {self.member_id}: the job finished before it switched to generation "
                             f"{t.generation}, which this process had formed with its members",
                       late=f"joiner {self.member_id}: the members formed generation {t.generation} with it but did "
                            f"not switch within {self.config.timeout:.0f}s")
        return json.loads(self.store.get(key).decode())

    def _poll_for(self, key: str, seconds: float, poll: float, on_wait: Callable[[float], None] | None, ended: str,
                  late: str) -> None:
        """A joiner: until ``key`` is in the store, poll it every ``poll`` seconds with check() (a store wait() that
        times out logs a warning every time), ``on_wait`` between polls. `JobEnded` (``ended``) once the job has
        finished; a TimeoutError once the job dropped this joiner, or after ``seconds`` (``late``)."""
        deadline, dropped = time.monotonic() + seconds, f"elastic/dropped/{self.member_id}"
        while not self._check_alive([key]):
            if self.store.check([FINISHED_KEY]):
                raise JobEnded(ended)
            if self.store.check([dropped]):
                raise TimeoutError(f"joiner {self.member_id} was dropped by the job: "
                                   f"{self.store.get(dropped).decode()}")
            if time.monotonic() > deadline:
                raise TimeoutError(late)
            if on_wait is not None:
                on_wait(time.monotonic())
            time.sleep(poll)

    def _check_alive(self, keys: list[str]) -> bool:
        """``store.check``, where a store that is gone means the job ended (its store lives with it)."""
        try:
            return self.store.check(keys)
        except RuntimeError as e:  # torch's DistNetworkError and DistStoreError are RuntimeErrors
            raise JobEnded(f"joiner {self.member_id}: the job's store at {self.endpoint} is gone, so is the job "
                           f"({type(e).__name__})") from None

    def finish(self) -> None:
        """The job's training ended: processes still waiting to join stop waiting."""
        try:
            self.store.set(FINISHED_KEY, "1")
        except RuntimeError:
            pass  # the store is gone already: so are the waiting processes' chances of admission

    def join_world(self, t: WorldChange, transfer) -> WorldGeneration:
        """A joiner's part of ``t``; a world it formed ahead already (``transfer`` None) is returned as it is."""
        from dynatrain.elastic.world import run_world_change

        if self.world is not None and self.world.generation == t.generation + len(t.steps) - 1:
            return self.world

        world = run_world_change(t, store=self.store, member_id=self.member_id, transfer=transfer,
                                 timeout=self.config.timeout, backend=self.backend)
        if world is None:
            raise RuntimeError(f"joiner {self.member_id} was admitted to a world change that does not keep it")
        self.world = world
        self.split_threads()
        return world

    def processes_on_this_host(self) -> int:
        """How many members of the current world registered this process's host (itself included)."""
        assert self.world is not None
        return processes_on_host(self.store, self.member_id, self.world.members)

    def split_threads(self, processes: int | None = None) -> int | None:
        """This process's share of its host's cores among the world's processes there (`threads.resplit`: only
        where dynatrain chose the count, and only in a CPU world: on GPUs the operators do not run on these
        threads, and the count reads every member's registration); the count set, or None. A member that left
        has no share to take."""
        if (self.world is None or not splits_threads(self.config.split_threads)
                or "nccl" in (self.backend or default_backend())):
            return None
        processes = processes or self.processes_on_this_host()  # ``processes``: counted ahead
        n = resplit(processes, split=True)
        self.thread_splits.append((processes, n))
        return n


def member_info(model_config: Any, code_version: str) -> dict[str, Any]:
    """What a process registers with: the job refuses a joiner whose values differ."""
    from dataclasses import asdict, is_dataclass

    from dynatrain.elastic.registry import config_hash

    cfg = asdict(model_config) if is_dataclass(model_config) else model_config
    return {"model_config_hash": config_hash(cfg), "code_version": code_version, "pid": os.getpid(),
            "host": host_name()}
