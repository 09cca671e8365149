"""`ElasticCallback`: resource-change signals in, one agreed layout switch out, at an optimizer-step boundary.

Each rank hears its own signals (`dynatrain.signals`): the control server and the watched file on global rank 0,
a preemption signal on every rank, the scripted trace on every rank. At a step boundary the ranks agree on one
request (`dynatrain.signals.agreement`), which turns into a target layout (`dynatrain.callbacks.rescale_plan`):

* an explicit layout is taken as it is; a device count (or, for a bare preemption, the current world minus the
  leaving ranks) goes to the layout planner, which on the same device count switches only when it pays;
* the target goes to ``strategy.request_switch``; anything the planner or the strategy refuses is logged and
  recorded, and training goes on. By default the switch is planned ahead: its plan is made on a background thread
  while one more step trains, and the switch runs at the end of that step, so the plan is not in the stall. A
  request with a deadline (a preemption notice) switches at the boundary where it was agreed.

    trainer = Trainer(strategy=DynaTrainStrategy(parallel="dp_shard=4"),
                      callbacks=[ElasticCallback(trace=[(100, 2), (300, "dp_shard=2,tp=2")], control=True)])
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from dynatrain.callbacks.rescale_options import read_or_create_token, signal_number, source_options, watch_options
from dynatrain.callbacks.rescale_plan import (
    Decision, Unpriced, accepts_keyword, accepts_leave, plan_target, workload_for,
)
from dynatrain.callbacks.switch_log import SwitchLog, resolve_run_dir
from dynatrain.elastic.rendezvous import launched_by_rendezvous
from dynatrain.settings import TOKEN_ENV, explicit_or_env
from dynatrain.policy import GiB, Devices, LayoutPolicy, choose_layout
from dynatrain.planner.network import NetworkModel
from dynatrain.signals.agreement import MergedRequest, Proposal, Slot, all_gather_slots, encode_slot, merge_proposals
from dynatrain.signals.control_server import ControlServer
from dynatrain.signals.file import FileSource
from dynatrain.signals.hub import SignalHub
from dynatrain.signals.preemption import PreemptionSource
from dynatrain.signals.request import ScaleRequest
from dynatrain.signals.trace import TraceSource
from dynatrain.vps.parallel_config import ParallelConfig

LOGGER = logging.getLogger("dynatrain.elastic")


class ElasticCallback(pl.Callback):
    """Rescale or re-layout a `DynaTrainStrategy` run when resources change.

    Args:
        trace: scripted ``[(step, devices or layout), ...]`` or ``[{step: N, devices: D}, ...]``; an entry
            fires at the first checked boundary at or after its step (after that many optimizer steps). A run
            resumed at step k fires the entries up to k at its first boundary, coalesced: the latest wins.
            ``{step: N, devices: D, wait: true}``: a scale-out holds training at step N until its joiners are
            ready (without it, training goes on and the scale-out comes at the first boundary they are ready).
        watch_file: a JSON file (``{"devices": 3}`` or ``{"layout": "..."}``, optionally with ``"wait": true``)
            watched on rank 0; a path, or ``{path, poll_seconds}``.
        control: ``True`` or ``{host, port, token | token_file, allow_remote}``: an HTTP endpoint on rank 0 for
            ``dynatrain scale``. The token comes from ``token``, else ``token_file`` (created with a fresh token
            when missing), else ``$DYNATRAIN_TOKEN``, else a fresh one in ``<run dir>/control.token``. The
            endpoint and token file are written to ``<run dir>/control.json``.
        preemption: ``True`` or ``{signum, grace_seconds}``: the signal (SIGTERM by default) tells a rank it
            goes away within the grace period; the job scales in without it. None: on in a worker of torchrun's
            ``dynatrain`` rendezvous backend (`dynatrain.elastic.rendezvous`), whose agent sends SIGTERM on when
            its node leaves.
        arrivals: at every checked boundary rank 0 asks for every joiner that is ready (registered, set up and
            beating): a node that arrived joins the job by a scale-out. None: on in a worker of torchrun's
            ``dynatrain`` backend, off under dynatrain's own launcher, whose standby pool waits for a request.
        max_devices: requests for more devices are refused.
        check_every_n_steps: agree on pending requests every this many optimizer steps (one small collective).
        horizon_steps: steps a new layout is expected to run; weighs a same-size re-layout against its cost.
        switch_fixed_seconds: a switch's stall besides moving bytes (rebuilding model and optimizer, agreeing),
            for the same weighing.
        device_memory_gb, devices_per_node, device_flops, device_efficiency, intra_node_gbps, inter_node_gbps:
            the devices as the layout planner sees them; defaults describe CPU processes on one machine
            (``devices_per_node`` None: all on one node).
        log_dir: run directory for ``switches.jsonl`` and ``control.json``; default the trainer's log dir.
        plan_ahead: plan an agreed switch on a background thread and run it one optimizer step later, at the end of
            the step trained meanwhile (``request_switch(..., plan_ahead=True)``), instead of planning it inside the
            stall at the boundary where it was agreed. A request with a deadline (a preemption) never waits. A
            scale-out is planned in the background either way, while its joiners get ready.
    """

    def __init__(
        self,
        trace: Sequence[Any] | None = None,
        watch_file: str | os.PathLike | dict | None = None,
        control: bool | dict = False,
        preemption: bool | dict | None = None,
        arrivals: bool | None = None,
        max_devices: int | None = None,
        check_every_n_steps: int = 1,
        horizon_steps: int = 200,
        switch_fixed_seconds: float = 1.0,
        device_memory_gb: float = 4.0,
        devices_per_node: int | None = None,
        device_flops: float = 50e9,
        device_efficiency: float = 0.5,
        intra_node_gbps: float = 20.0,
        inter_node_gbps: float = 10.0,
        log_dir: str | None = None,
        plan_ahead: bool = True,
    ) -> None:
        if isinstance(check_every_n_steps, bool) or not isinstance(check_every_n_steps, int) \
                or check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be a positive integer, got {check_every_n_steps!r}")
        self.hub = SignalHub(max_devices)  # validates max_devices
        self.max_devices = max_devices
        self.trace_entries = list(trace or [])
        TraceSource(self.trace_entries, max_devices)  # a bad trace fails here, before any training
        self.watch = watch_options(watch_file)
        self.control = source_options(control, "control", {"host", "port", "token", "token_file", "allow_remote"})
        launched = launched_by_rendezvous()
        self.preemption = source_options(launched if preemption is None else preemption, "preemption",
                                         {"signum", "grace_seconds"})
        self.arrivals = launched if arrivals is None else bool(arrivals)
        # Stands down for an ElasticCallback of the user's (`for_launcher`).
        self.defers_to_user = False
        self._arrivals_asked: tuple[int, int] | None = None
        self.check_every_n_steps = check_every_n_steps
        self.policy = LayoutPolicy(horizon_steps=horizon_steps, fixed_seconds=switch_fixed_seconds)
        self.device_spec = dict(memory_bytes=int(device_memory_gb * GiB), per_node=devices_per_node,
                                flops=device_flops, efficiency=device_efficiency,
                                intra_node_gbps=intra_node_gbps, inter_node_gbps=inter_node_gbps)
        self.devices_for(1)  # check the device description now
        self.log_dir = log_dir
        self.plan_ahead = bool(plan_ahead)
        self.decisions: list[Decision] = []
        self.switch_log: SwitchLog | None = None
        self.control_server: ControlServer | None = None
        self.control_endpoint: str | None = None
        self.token_file: Path | None = None
        self.run_dir: Path | None = None
        self._trace: TraceSource | None = None
        self._skip_past_trace = False
        self._listeners: list[Any] = []
        self._preemption_source: PreemptionSource | None = None
        self._listen_error: str | None = None
        self._last_checked: int | None = None

    # ---- planner inputs -----------------------------------------------------------------------------------
    def devices_for(self, count: int) -> Devices:
        spec = self.device_spec
        per_node = spec["per_node"] or count
        network = NetworkModel(gpus_per_node=per_node, link_gbps=spec["inter_node_gbps"], nics_per_node=1,
                               intra_node_gbps=spec["intra_node_gbps"], round_latency_s=1e-4)
        return Devices(count, spec["memory_bytes"], per_node, spec["flops"], spec["efficiency"], network)

    @property
    def rejections(self) -> list[Decision]:
        """Requests that were agreed on but refused (by the planner, the strategy or this callback)."""
        return [d for d in self.decisions if d.action == "reject"]

    # ---- Lightning hooks ----------------------------------------------------------------------------------
    @classmethod
    def for_launcher(cls) -> "ElasticCallback":
        """The callback Lightning adds to a Trainer in a worker of torchrun's ``dynatrain`` backend (the
        ``lightning.pytorch.callbacks_factory`` entry point): arrivals and preemption on, planned by the job's
        policy; it does nothing where the Trainer has an ElasticCallback of the user's."""
        callback = cls(arrivals=True, preemption=True)
        callback.defers_to_user = True
        return callback

    def _inert(self, trainer: pl.Trainer) -> bool:
        return self.defers_to_user and any(isinstance(cb, ElasticCallback) and not cb.defers_to_user
                                           for cb in trainer.callbacks)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._inert(trainer):
            return
        if not hasattr(trainer.strategy, "request_switch"):
            raise TypeError(f"ElasticCallback needs a strategy that can switch layouts (DynaTrainStrategy), "
                            f"got {type(trainer.strategy).__name__}")
        # The layout the survivors of a lost process go on with: this callback's policy.
        trainer.strategy.layout_chooser = lambda count: choose_layout(self.devices_for(count),
                                                                       workload_for(trainer)).config
        found = [cb for cb in trainer.callbacks if isinstance(cb, SwitchLog)]
        if found:
            self.switch_log = found[0]
        else:
            self.switch_log = SwitchLog(log_dir=self.log_dir)
            trainer.callbacks.append(self.switch_log)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._inert(trainer):
            return
        self.run_dir = resolve_run_dir(trainer, self.log_dir)  # a collective: before any rank-0-only branch
        self._last_checked = None
        self._trace = TraceSource(self.trace_entries, self.max_devices)
        # A process joining a running job (the strategy keeps its collectives local until training starts) must
        # not replay trace entries the members acted on before it came.
        self._skip_past_trace = bool(getattr(trainer.strategy, "local_only", False))
        try:
            self._start_sources(trainer)
        except BaseException:
            self.close()
            raise

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._inert(trainer):
            return
        if getattr(trainer.strategy, "detached", False):
            self.close()  # this process has left the job: it no longer takes requests
            return
        at_boundary = getattr(trainer.strategy, "at_step_boundary", None)
        if at_boundary is None or not at_boundary():
            return
        step = trainer.global_step
        if step == self._last_checked or step % self.check_every_n_steps:
            return
        self._last_checked = step
        self.check(trainer, step)

    def on_train_end(self, trainer, pl_module) -> None:
        # Here, not only in on_fit_end: Lightning's teardown, which runs between the two, puts back every signal
        # handler it found at start, and ours must be gone by then for each to restore the right one.
        self.close()

    def on_fit_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.close()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.close()

    def close(self) -> None:
        """Stop every source (idempotent); a failure to stop one is logged, never raised into training."""
        try:
            self.hub.close()
        except Exception:
            LOGGER.exception("stopping the elastic signal sources failed")
        self.control_server = None
        self._listeners = []
        self._preemption_source = None

    # ---- sources ------------------------------------------------------------------------------------------
    def _start_sources(self, trainer: pl.Trainer) -> None:
        rank = trainer.global_rank
        if self.preemption is not None:
            # Here and not in setup: Lightning installs its own SIGTERM handler during setup, which would stop
            # training instead of scaling in; ours replaces it and puts it back on close.
            signum = signal_number(self.preemption.get("signum", signal.SIGTERM))
            self._preemption_source = PreemptionSource(self.hub, rank, signum,
                                                       float(self.preemption.get("grace_seconds", 30.0)))
        if rank == 0 and not getattr(trainer.strategy, "local_only", False):
            self._start_listeners(self.run_dir)

    @property
    def _wants_listeners(self) -> bool:
        return self.control is not None or self.watch is not None

    def _start_listeners(self, run_dir: Path) -> None:
        if self.control is not None:
            self._listeners.append(self._start_control(run_dir))
        if self.watch is not None:
            self._listeners.append(FileSource(self.hub, self.watch["path"],
                                              poll_seconds=float(self.watch.get("poll_seconds", 0.5))))

    def _take_over_listeners(self, trainer: pl.Trainer, slots: Sequence[Slot]) -> None:
        """Start the control server and file watcher here when no rank runs them (the process that did left).

        A failure (the old server's port not yet free) is logged once and retried at the next check.
        """
        if not self._wants_listeners or trainer.global_rank != 0 or any(s.listening for s in slots):
            return
        try:
            self._start_listeners(self.run_dir or Path(trainer.default_root_dir))
        except OSError as err:
            for source in self._listeners:
                source.close()
            self._listeners = []
            if self._listen_error != str(err):
                LOGGER.warning("cannot start the control server / file watcher on this rank yet: %s", err)
            self._listen_error = str(err)
            return
        self._listen_error = None
        rank_zero_info("the control server and file watcher moved to this process (the previous rank 0 left)")

    def _start_control(self, run_dir: Path) -> ControlServer:
        opts = self.control
        token = self._token(opts, run_dir)
        server = ControlServer(self.hub, token, host=opts.get("host", "127.0.0.1"), port=int(opts.get("port", 0)),
                               allow_remote=bool(opts.get("allow_remote", False)))
        self.control_server, self.control_endpoint = server, server.endpoint
        info = {"endpoint": server.endpoint, "token_file": str(self.token_file) if self.token_file else None}
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "control.json").write_text(json.dumps(info) + "\n")
        where = f"token in {self.token_file}" if self.token_file else "the token you configured"
        rank_zero_info(f"scale requests: dynatrain scale --endpoint {server.endpoint} --devices N ({where})")
        return server

    def _token(self, opts: dict, run_dir: Path) -> str:
        if opts.get("token"):
            return str(opts["token"])
        if opts.get("token_file"):
            self.token_file = Path(opts["token_file"])
            return read_or_create_token(self.token_file)
        from_env = explicit_or_env(None, TOKEN_ENV)
        if from_env:
            return from_env
        self.token_file = run_dir / "control.token"
        return read_or_create_token(self.token_file, fresh=True)

    # ---- the boundary -------------------------------------------------------------------------------------
    def check(self, trainer: pl.Trainer, step: int) -> Decision | None:
        """Agree on pending requests and act on them; every rank calls it at the same boundary."""
        start = time.perf_counter()
        due = self._trace.due(step) if self._trace is not None else []
        if not self._skip_past_trace:
            for request in due:
                self.hub.submit(request)
        self._skip_past_trace = False
        if self.arrivals:
            self._ask_for_arrivals(trainer)
        slots = self._exchange(trainer, Slot(self._local_proposal(trainer), bool(self._listeners)))
        self._take_over_listeners(trainer, slots)
        merged = merge_proposals([slot.proposal for slot in slots])
        if merged is None:
            return None
        decision = self._decide(trainer, merged, step)
        decision.agreement_s = time.perf_counter() - start
        decision.signal_to_decision_s = max(0.0, time.time() - merged.wall_time)
        self._record(trainer, decision)
        return decision

    def _ask_for_arrivals(self, trainer: pl.Trainer) -> None:
        """On rank 0: a scale-out for every ready joiner, unless one is already under way. Others hear of it in the
        agreement; the joiners are admitted by the switch, at this boundary or the next."""
        strategy = trainer.strategy
        if trainer.global_rank != 0 or getattr(strategy, "switch_pending", True) \
                or not hasattr(strategy, "ready_standby"):
            return
        ready = strategy.ready_standby() or 0
        devices = strategy.world_size + ready
        if self.max_devices is not None:
            devices = min(devices, self.max_devices)
        asked, self._arrivals_asked = self._arrivals_asked, (strategy.world_size, devices)
        # Once per pool and world: a refused scale-out (a global batch the count cannot keep) is not asked again
        # at every step, only when another process arrives or the world changes.
        if devices > strategy.world_size and asked != (strategy.world_size, devices):
            self.hub.submit(ScaleRequest(devices=devices, source="arrival",
                                         reason=f"{ready} process(es) arrived and are ready to join"))

    def _local_proposal(self, trainer: pl.Trainer) -> Proposal | None:
        rank = trainer.global_rank
        renumbered = self._follow_rank(rank)
        request = self.hub.poll()
        if request is None:
            return None
        if renumbered is not None and renumbered in request.leave:
            request = dataclasses.replace(request, leave=tuple(set(request.leave) - {renumbered} | {rank}))
        proposal = Proposal.from_request(rank, request)
        try:
            encode_slot(Slot(proposal, True))
        except ValueError as err:
            # Refuse it here rather than fail the collective every rank is about to enter.
            self.hub.reject(request.source, str(err), request)
            return None
        return proposal

    def _follow_rank(self, rank: int) -> int | None:
        """Keep the preemption source naming this process after a world change renumbered the ranks; returns
        the rank it named before, which a signal that came in the meantime still carries."""
        source = self._preemption_source
        if source is None or source.rank == rank:
            return None
        previous, source.rank = source.rank, rank
        return previous

    def _exchange(self, trainer: pl.Trainer, slot: Slot) -> list[Slot]:
        # The strategy's control group (`dynatrain.runtime.control_group`); under another strategy, the default group.
        return all_gather_slots(slot, getattr(trainer.strategy, "control_group", None))

    def _decide(self, trainer: pl.Trainer, merged: MergedRequest, step: int) -> Decision:
        strategy = trainer.strategy
        base = dict(step=step, request=merged.describe(), source=merged.source, leave=merged.leave,
                    sources=merged.sources)
        can_change_world = accepts_leave(strategy.request_switch)
        if merged.source == "arrival" and merged.leave:
            # Counted as "the world and the arrivals": ranks leaving at the same boundary do not stay.
            merged = dataclasses.replace(merged, devices=max(1, merged.devices - len(merged.leave)))
        try:
            plan = plan_target(merged, strategy.parallel_config, strategy.world_size,
                               planner=lambda count, leave: self._plan_layout(trainer, count, leave),
                               can_change_world=can_change_world)
            if plan.target is None:
                return Decision(action="keep", reason=plan.reason, **base)
            report_index = len(strategy.switch_reports)
            options = {"leave": merged.leave} if can_change_world else {}
            # Only a world change has joiners to wait for; a strategy that cannot change worlds is never asked.
            if merged.wait and can_change_world and accepts_keyword(strategy.request_switch, "wait"):
                options["wait"] = True
            # A deadline leaves no step to spare: the preempted process must be gone before it.
            if self.plan_ahead and merged.deadline_in is None \
                    and accepts_keyword(strategy.request_switch, "plan_ahead"):
                options["plan_ahead"] = True
            standby = None
            if plan.target.world_size > strategy.world_size and hasattr(strategy, "ready_standby"):
                standby = strategy.ready_standby()  # the warm pool this scale-out admits from first
            target = strategy.request_switch(plan.target, **options)
        except ValueError as err:
            return Decision(action="reject", reason=str(err), **base)
        # The fixed-world strategy returns the validated layout; take the plan's when a strategy returns nothing.
        target = ParallelConfig.parse(target) if isinstance(target, (str, ParallelConfig)) else plan.target
        return Decision(action="switch", target=target.short(), reason=f"{plan.reason} ({merged.reason})",
                        report_index=report_index, standby=standby, **base)

    def _plan_layout(self, trainer: pl.Trainer, count: int, leave: tuple[int, ...]):
        strategy = trainer.strategy
        positions = getattr(strategy, "positions", None)
        policy = self.policy
        budget = getattr(getattr(strategy, "switching", None), "budget_bytes", None)
        if budget is not None and budget != policy.budget_bytes:
            policy = LayoutPolicy(policy.horizon_steps, policy.cost, budget, policy.fixed_seconds, policy.max_priced)
        try:
            workload = workload_for(trainer)
        except ValueError as err:
            # A device count is still a request the job can serve (a preemption above all): take the strategy's
            # own fallback layout rather than refuse it for want of a price.
            return Unpriced(strategy.parallel_config, count, str(err))
        return policy.decide(self.devices_for(count), workload, strategy.parallel_config,
                             rank_map=positions, leave=leave)

    def _record(self, trainer: pl.Trainer, decision: Decision) -> None:
        self.decisions.append(decision)
        if decision.action == "switch" and self.switch_log is not None:
            self.switch_log.note_decision(decision.report_index, {
                k: v for k, v in decision.as_dict().items() if k not in ("report_index",)})
        if trainer.global_rank != 0:
            return
        text = f"step {decision.step}: {decision.source} request {decision.request}: "
        if decision.action == "reject":
            LOGGER.warning(text + "rejected: %s", decision.reason)
        elif decision.action == "keep":
            rank_zero_info(text + f"layout kept: {decision.reason}")
        else:
            pool = "" if decision.standby is None else f"; {decision.standby} standby process(es) ready to join"
            rank_zero_info(text + f"switching to {decision.target}: {decision.reason}{pool}")
