"""`dynatrain selfcheck --inject`: kill a process for real at a chosen moment and check what the job did.

Each scenario runs an elastic job on CPU processes under one store, kills one process with SIGKILL, and reports
``{"scenario", "recovered", "steps_lost", "state_equal_to_committed"}``:

- ``rank-dies``: a member dies inside an optimizer step of an HSDP job (every shard on two processes). The
  survivors must rebuild the state from the replicas in memory and finish the run.
- ``joiner-dies``: a process that came to join a scale-out dies before it is ready. The scale-out must be dropped
  and training go on on the current world.
- ``leaver-dies``: the process leaving in a 2 -> 1 scale-in dies while the switch moves the state. The engine frees shards
  as it sends them, so the survivors cannot rebuild in memory: they must stop with a clear error (no hang), and
  the job restarts on the processes left from its latest committed snapshot (taken every 2 steps).

"Committed" is the state after the last optimizer step every process completed. Every process saves it with
DCP at that boundary (an independent path: DCP's own resharding, not the switch engine); after the fault the
processes that go on load it into their current layout and compare bitwise with what they train on.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl

from dynatrain.selfcheck import oracle

# Micro-batches in a scenario's global batch: every world a scenario runs on (4, 3, 2, 1 processes) divides it.
GLOBAL_MICRO_BATCHES = 12

# Per scenario: the processes the job starts with, its layout, the joiners, the ranks that are killed, and the
# optimizer step whose end is the committed state (the fault comes during the next one).
SCENARIOS: dict[str, dict] = {
    "rank-dies": {"devices": 4, "layout": "dp_replicate=2,dp_shard=2", "joiners": 0, "victims": [3],
                  "committed_step": 2, "steps": 4, "max_steps_lost": 0},
    "joiner-dies": {"devices": 2, "layout": "dp_shard=2", "joiners": 1, "victims": [],
                    "committed_step": 2, "steps": 4, "max_steps_lost": 0},
    # The snapshot of step 2 is the committed state; the scale-in to 1 process at step 3 loses its leaver.
    "leaver-dies": {"devices": 2, "layout": "dp_shard=2", "joiners": 0, "victims": [1], "committed_step": 2,
                    "fault_step": 3, "steps": 5, "snapshot_every": 2, "max_steps_lost": 2,
                    "restart": {"devices": 1, "layout": "dp_shard=1"}},
}


class InjectFault(pl.Callback):
    def __init__(self, scenario: str, workdir: Path, restarted: bool = False):
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown fault scenario {scenario!r}; choose from {sorted(SCENARIOS)}")
        self.scenario, self.spec = scenario, SCENARIOS[scenario]
        self.restarted = restarted  # the job started again from its latest snapshot after the fault
        self.workdir = Path(workdir)
        self.committed = self.workdir / "committed"
        self.saved = False
        self.recoveries_seen = 0
        self.state_equal: bool | None = None
        self.steps_lost: int | None = None

    def callbacks(self) -> list[pl.Callback]:
        """What the scenario needs besides this callback: snapshots, for the one that restarts from them."""
        if "snapshot_every" not in self.spec:
            return []
        from dynatrain.callbacks.snapshot import Snapshot

        return [Snapshot(every_n_steps=self.spec["snapshot_every"], dirpath=self.snapshots)]

    @property
    def snapshots(self) -> Path:
        return self.workdir / "snapshots"

    def on_train_start(self, trainer, pl_module) -> None:
        if self.restarted:
            # Restored from the latest snapshot: compare before training on.
            self.steps_lost = self.spec["fault_step"] - trainer.global_step
            self._compare(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        if self.restarted or not strategy.at_step_boundary():
            return
        if self.scenario == "leaver-dies" and trainer.global_step == self.spec["fault_step"]:
            self._scale_in_losing_a_leaver(strategy)
            return
        if self.saved or trainer.global_step != self.spec["committed_step"]:
            return
        self.saved = True
        oracle.save(pl_module, strategy.optimizers[0], self.committed)
        if self.scenario == "joiner-dies":
            self._scale_out_to_a_dead_joiner(trainer, pl_module)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        victim = self.scenario == "rank-dies" and int(os.environ.get("RANK", "-1")) in self.spec["victims"]
        if victim and self.saved and trainer.global_step == self.spec["committed_step"]:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: its peers wait on this backward's collectives

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        reports = trainer.strategy.recovery_reports
        if len(reports) > self.recoveries_seen:
            self.recoveries_seen = len(reports)
            # The survivors' state, before it trains again, against the committed one.
            # Optimizer steps completed before the fault minus those in the rebuilt state (which the comparison
            # then checks is the committed one).
            self.steps_lost = reports[-1].step - trainer.global_step
            self._compare(trainer, pl_module)

    def _scale_in_losing_a_leaver(self, strategy) -> None:
        """Half the processes leave; one of them dies as the transfer starts, after its peers began theirs."""
        if int(os.environ.get("RANK", "-1")) in self.spec["victims"]:
            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            strategy.switch_transfer = die
        world = strategy.world_size
        strategy.request_switch(f"dp_shard={world // 2}", leave=list(range(world // 2, world)))

    def _scale_out_to_a_dead_joiner(self, trainer, pl_module) -> None:
        """Ask for one more process; the one that came dies before it is ready. Driven at this boundary until the
        job decides, so the state compared is the committed one."""
        strategy = trainer.strategy
        done = len(strategy.switch_reports)
        strategy.request_switch(f"dp_shard={strategy.world_size + 1}")
        while strategy.switch_pending:
            strategy.run_pending_switch()
            if strategy.switch_pending:
                time.sleep(0.2)
        if len(strategy.switch_reports) == done:
            self.steps_lost = 0
            self._compare(trainer, pl_module)

    def _compare(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        model, optimizer = oracle.load_into_layout(strategy, pl_module, self.committed)
        self.state_equal = oracle.bitwise_equal(pl_module, strategy.optimizers[0], model, optimizer,
                                                strategy.root_device)

    def result(self, trainer) -> dict:
        strategy = trainer.strategy
        return {"scenario": self.scenario, "global_step": trainer.global_step, "world_size": trainer.world_size,
                "layout": strategy.parallel_config.short(), "recoveries": len(strategy.recovery_reports),
                "switches": len(strategy.switch_reports), "state_equal": self.state_equal,
                "steps_lost": self.steps_lost, "recovery": [r.as_dict() for r in strategy.recovery_reports]}


def die_before_ready() -> None:
    """In a joiner of the ``joiner-dies`` scenario: register, then die instead of saying it is ready."""
    from dynatrain.elastic.manager import ElasticManager

    ElasticManager.mark_ready = lambda self: os.kill(os.getpid(), signal.SIGKILL)


def summarise(scenario: str, members: list[dict | None], steps: int) -> dict:
    """One verdict from the processes that went on (the victims report nothing)."""
    spec = SCENARIOS[scenario]
    alive = [m for m in members if m is not None]
    expected = spec["restart"]["devices"] if "restart" in spec else spec["devices"] - len(spec["victims"])
    went_on = len(alive) == expected and all(m["global_step"] == steps for m in alive)
    if scenario == "rank-dies":
        recovered = went_on and all(m["recoveries"] == 1 and m["world_size"] == len(alive) for m in alive)
    else:
        recovered = went_on and all(m["switches"] == 0 and m["world_size"] == spec["devices"] for m in alive)
    if scenario == "leaver-dies":
        recovered = went_on  # here: the restarted job, on the processes left
    lost = [m["steps_lost"] for m in alive if m["steps_lost"] is not None]
    equal = [m["state_equal"] for m in alive]
    return {"scenario": scenario, "recovered": recovered,
            "steps_lost": max(lost) if len(lost) == len(alive) and alive else None,
            "state_equal_to_committed": bool(equal) and all(e is True for e in equal),
            "layout_after": alive[0]["layout"] if alive else None,
            "recovery_seconds": max((r["seconds"] for m in alive for r in m["recovery"]), default=None)}


def run_scenarios(args) -> int:
    """The CLI: each scenario of ``args.inject`` in turn; exit 0 only when every one recovered, lost at most
    the steps it may, and ended on the committed state."""
    import json
    import tempfile

    from dynatrain.launch.local import LaunchError

    names = [n.strip() for n in args.inject.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise SystemExit(f"--inject: unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    out = []
    for name in names:
        spec = SCENARIOS[name]
        with tempfile.TemporaryDirectory(prefix=f"dynatrain-inject-{name}-") as tmp:
            argv = ["-m", "dynatrain.selfcheck.worker", "--model", args.model, "--layouts", spec["layout"],
                    "--steps", str(spec["steps"]), "--global-batch", str(GLOBAL_MICRO_BATCHES * args.micro_batch),
                    "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
                    "--budget-mb", str(args.budget_mb), "--workdir", tmp, "--inject", name, "--elastic",
                    "--elastic-timeout", "20", "--join-timeout", "10"]
            if args.n_layers:
                argv += ["--n-layers", str(args.n_layers)]
            for flag in ("module", "datamodule"):  # a module of the user's own, as the switching selfcheck takes
                if getattr(args, flag, None):
                    argv += [f"--{flag}", getattr(args, flag)]
            started = time.monotonic()
            try:
                verdict = _run_one(name, spec, argv, Path(tmp), args.timeout)
            except LaunchError as e:
                verdict = {"scenario": name, "recovered": False, "steps_lost": None,
                           "state_equal_to_committed": False, "error": str(e)[-2000:]}
            verdict["seconds"] = round(time.monotonic() - started, 1)
        verdict["model"] = args.module or args.model
        verdict["ok"] = bool(verdict["recovered"] and verdict["steps_lost"] is not None
                             and verdict["steps_lost"] <= spec["max_steps_lost"]
                             and verdict["state_equal_to_committed"])
        out.append(verdict)
        if not args.json:
            print(f"{name}: recovered={verdict['recovered']} steps_lost={verdict['steps_lost']} "
                  f"state_equal_to_committed={verdict['state_equal_to_committed']} ({verdict['seconds']}s)"
                  + ("" if verdict["ok"] else f"\n{verdict.get('error', '')}"))
    if args.json:
        print(json.dumps(out[0] if len(out) == 1 else out))
    return 0 if all(v["ok"] for v in out) else 1


def _run_one(name: str, spec: dict, argv: list[str], workdir: Path, timeout: float) -> dict:
    from dynatrain.launch.local import PRELOAD, LaunchError, launch_elastic, launch_local

    if "restart" not in spec:
        members, _ = launch_elastic(argv, spec["devices"], workdir, joiners=spec["joiners"], timeout=timeout,
                                    name=name, grace=120, may_die=spec["victims"], joiners_may_die=True,
                                    preload=PRELOAD, keep_zygote=True)
        return summarise(name, members, spec["steps"])
    # The fault must stop the job with a clear error, on every survivor, well within its timeout...
    try:
        launch_elastic(argv, spec["devices"], workdir, timeout=timeout, name=name, grace=120,
                       may_die=spec["victims"], preload=PRELOAD, keep_zygote=True)
        return {"scenario": name, "recovered": False, "steps_lost": None, "state_equal_to_committed": False,
                "error": "the job went on after losing a leaver mid-transfer"}
    except LaunchError as e:
        if "WorldChangeError" not in str(e):
            raise
    # ... and the job then starts again on the processes left, from its latest committed snapshot.
    restart = spec["restart"]
    layouts = argv.index("--layouts") + 1
    again = [*argv[:layouts], restart["layout"], *argv[layouts + 1:], "--restarted"]
    again.remove("--elastic")
    members = launch_local(again, restart["devices"], workdir, timeout=timeout, name=f"{name}-restart",
                           preload=PRELOAD, keep_zygote=True)
    return summarise(name, members, spec["steps"])
