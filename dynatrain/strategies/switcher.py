"""`Switcher`: runs a layout switch for `DynaTrainStrategy`, only at optimizer-step boundaries.

Order of a switch (every rank runs the same steps on the same inputs, so every collective matches):
check the target (nothing has moved: a bad target leaves training untouched) -> plan (pure, identical on
every rank) -> build the new mesh (same group calls in the same order everywhere) and the new model on meta ->
run the transfer -> materialise the new model and adopt weights, Adam moments, step, LR schedule, data position
and gradient accumulation -> optionally verify bitwise.
"""

from __future__ import annotations

import gc
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from dynatrain.engine.transition import run_transition, validate_sources
from dynatrain.engine.verify import SwitchVerificationError, compare, differing, local_checksums, reduce_sums
from dynatrain.memory import release_freed_memory
from dynatrain.planner.schedule import plan_switch
from dynatrain.strategies.elastic import (
    JoinState,
    adopt_logger_versions,
    decode_scalars,
    encode_scalars,
    logger_versions,
    loop_checkpoint,
    set_world,
)
from dynatrain.strategies.prepare import (
    ChangeInputs,
    JoinerPrep,
    MemberPrep,
    plan_from_payload,
    plan_mesh_safe,
    plan_world_change,
)
from dynatrain.strategies.adopt import fill_target, restore_optimizer
from dynatrain.strategies.capture import capture, check_switchable, target_shardings
from dynatrain.strategies.stage_capture import merge_stages
from dynatrain.strategies.pipeline import check_pipeline_module
from dynatrain.models.pipeline import pipeline_stages
from dynatrain.strategies.probe import probe_mesh
from dynatrain.strategies.recovery import WorldChangeError, is_peer_loss, recover
from dynatrain.strategies.target import param_children, release_children, transplant
from dynatrain.strategies.switch import PhaseTimer, SwitchReport
from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig

if TYPE_CHECKING:
    from dynatrain.strategies.dynatrain import DynaTrainStrategy


class _BoundaryHook(pl.Callback):
    """Keeps the switcher in step with Lightning's epochs and start; a requested switch runs right after the
    micro-batch that closed an optimizer step (see `Switcher._wrap_advance`)."""

    def __init__(self, switcher: "Switcher") -> None:
        self.switcher = switcher

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.switcher.accumulation_offset = 0  # Lightning's batch counter restarts with each epoch

    def on_train_start(self, trainer, pl_module) -> None:
        self.switcher.on_train_start()





class _BuildFailed(Exception):
    """The module's own parallelisation raised (its ``__cause__``) while a target layout was built."""


@dataclass
class _Pending:
    target: ParallelConfig
    leave: tuple[int, ...]
    requested_at: float
    wait: bool = False  # a scale-out holds training at its boundary until its joiners are ready (or time out)


class Switcher:
    def __init__(self, strategy: "DynaTrainStrategy") -> None:
        self.strategy = strategy
        self.pending: _Pending | None = None
        self.joined = None  # a joiner's JoinState until training starts
        self.prepared: MemberPrep | None = None  # the pending world change, planned in the background
        self.accumulation_offset = 0
        self.trainer: pl.Trainer | None = None
        self._target_shardings: dict[ParallelConfig, dict] = {}  # per target layout: parameter -> Sharding
        self._probes: dict = {}  # target layout -> its meta build on the default rank order, made at request time
        self.released = False  # the old layout's state was handed to the engine: a failure now cannot be undone

    # ---- Lightning wiring ---------------------------------------------------------------------------------
    def attach(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        if not any(isinstance(cb, _BoundaryHook) for cb in trainer.callbacks):
            trainer.callbacks.append(_BoundaryHook(self))
        loop = trainer.fit_loop.epoch_loop
        # Lightning closes a step when (micro-batches this epoch) % accumulation == 0; after a switch changes the
        # accumulation mid-epoch, count from the switch instead so steps stay whole.
        loop._accumulated_batches_reached = lambda: (
            (loop.batch_progress.current.ready - self.accumulation_offset) % trainer.accumulate_grad_batches == 0
        )
        # The same for zeroing gradients, which Lightning keys on batch_idx % accumulation.
        auto = loop.automatic_optimization

        def make_zero_grad_fn(batch_idx: int, optimizer):
            if auto._skip_backward or (batch_idx - self.accumulation_offset) % trainer.accumulate_grad_batches:
                return None
            if self.strategy.pipeline is not None:
                # Lightning zeroes between a micro-batch's step and its backward; a pipeline's backward ran inside
                # the step, so the strategy zeroes before the schedule instead.
                return None

            def zero_grad_fn() -> None:
                auto._on_before_zero_grad(optimizer)
                auto._optimizer_zero_grad(batch_idx, optimizer)

            return zero_grad_fn

        auto._make_zero_grad_fn = make_zero_grad_fn
        self._wrap_advance(loop)

    def _wrap_advance(self, loop) -> None:
        """Around each micro-batch: a pending switch runs once the micro-batch that closed a step is done; in an
        elastic job, a process lost during a micro-batch is recovered from (see `recovery`), the micro-batch then
        counts as consumed and its step runs again under the survivors' layout."""
        advance, advance_end = loop.advance, loop.on_advance_end
        skip_end = [False]

        def guarded_advance(data_fetcher) -> None:
            try:
                advance(data_fetcher)
            except Exception as e:
                if not self._recoverable(e):
                    raise
                error = e
            else:
                # After every on_train_batch_end, the LightningModule's included: what the module does at the end
                # of a step (a buffer it updates, say) is part of the state that moves.
                if self.pending is not None and self.at_boundary():
                    self.run_pending()
                return
            # Outside the handler, without the traceback: its frames hold the step's tensors, which hold the
            # broken groups open.
            error.__traceback__ = None
            recover(self, error)
            progress = loop.batch_progress
            for step in ("started", "processed", "completed"):
                while getattr(progress.current, step) < progress.current.ready:
                    getattr(progress, f"increment_{step}")()
            skip_end[0] = True  # no validation, scheduler or logger step for a micro-batch that did not run

        def guarded_advance_end(data_fetcher) -> None:
            if skip_end[0]:
                skip_end[0] = False
                return
            advance_end(data_fetcher)

        loop.advance, loop.on_advance_end = guarded_advance, guarded_advance_end

    def _recoverable(self, error: BaseException) -> bool:
        strategy = self.strategy
        if strategy.elastic is None or not strategy.elastic.config.recover or strategy.detached:
            return False
        if isinstance(error, (WorldChangeError, SwitchVerificationError)) or not is_peer_loss(error):
            return False
        return not self.released  # a switch that began moving state cannot be undone

    def at_boundary(self) -> bool:
        trainer = self.trainer
        if trainer is None or not trainer.training:
            return True
        loop = trainer.fit_loop.epoch_loop
        done = loop.batch_progress.current.ready - self.accumulation_offset
        return done % trainer.accumulate_grad_batches == 0

    # ---- requests -----------------------------------------------------------------------------------------
    def check(self, target: str | ParallelConfig, world_size: int | None = None) -> ParallelConfig:
        """Parse and validate a target against the devices, the model and the global batch."""
        strategy = self.strategy
        world_size = strategy.world_size if world_size is None else world_size
        target = ParallelConfig.parse(target).validate(strategy.model_config(), world_size)
        if target.pp > 1:
            check_pipeline_module(strategy.lightning_module)
            n_layers = getattr(strategy.model_config(), "n_layers", None)
            stages = target.pp * strategy.stages_per_rank
            if n_layers is not None and stages > n_layers:
                raise ValueError(f"{target.short()} with {strategy.stages_per_rank} stage(s) per rank needs {stages} "
                                 f"pipeline stages of at least one layer, and the model has {n_layers}: use a "
                                 f"smaller pp")
        datamodule = getattr(self.trainer, "datamodule", None) if self.trainer else None
        if datamodule is not None and hasattr(datamodule, "accumulation_for"):
            try:
                datamodule.accumulation_for(target.dp_size)
            except ValueError as e:
                raise ValueError(f"cannot switch to {target.short()}: {e}") from None
        return target

    def check_world(self, target: ParallelConfig, leave: tuple[int, ...]) -> None:
        """A world change needs the elastic manager, known leavers and room under max_devices."""
        strategy = self.strategy
        world = strategy.world_size
        bad = [r for r in leave if not 0 <= r < world]
        if bad:
            raise ValueError(f"leave={list(leave)}: ranks {bad} are not in the current world of {world} processes")
        if target.world_size == world and not leave:
            return
        if strategy.elastic is None:
            raise ValueError(
                f"{target.short()} needs dp_replicate*dp_shard*tp = {target.world_size} devices, but there are "
                f"{world}: changing the number of processes needs an elastic job (DynaTrainStrategy(elastic=...), "
                "started with `dynatrain fit --elastic.max_devices N`)"
            )
        cap = strategy.elastic.config.max_devices
        if cap is not None and target.world_size > cap:
            raise ValueError(f"{target.short()} needs {target.world_size} processes, above elastic max_devices={cap}")

    def _check_module(self, target: ParallelConfig, probe: bool = False) -> None:
        """Refuse now what the switch could not carry: the module's states, and its parallelisation for ``target``
        (run on meta; the result is kept for the switch)."""
        strategy = self.strategy
        if getattr(strategy, "lightning_module", None) is None:
            return  # nothing set up yet: the module is checked when the switch runs
        check_switchable(strategy.lightning_module, strategy.optimizers)
        captured = self.capture_states(strategy.lightning_module, self.optimizer())
        _, built = self.target_layout(target, captured, probe=probe)
        if built is not None:
            self._probes[target] = built

    def request(self, target: str | ParallelConfig, leave=(), wait: bool = False) -> ParallelConfig:
        leave = tuple(sorted({int(r) for r in leave}))
        parsed = ParallelConfig.parse(target)
        self.check_world(parsed, leave)
        target = self.check(parsed, world_size=parsed.world_size)
        self._check_module(target, probe=parsed.world_size != self.strategy.world_size or bool(leave))
        self.pending = _Pending(target, leave, time.monotonic(), wait)
        self.prepared = None
        if self.trainer is None or not self.trainer.training:
            self.run_pending()
        return target

    def run_pending(self) -> SwitchReport | None:
        """Run the pending request if it can run now; a scale-out waits (across boundaries) for its joiners."""
        p = self.pending
        if p is None:
            return None
        strategy = self.strategy
        if p.target.world_size == strategy.world_size and not p.leave:
            self.pending = None
            with self._refusable(p):
                return self.switch(p.target)
            return None
        change = f"world change {strategy.parallel_config.short()} -> {p.target.short()}"
        try:
            joiners = self._agree_on_joiners(p)
            while joiners is None and p.wait:  # every rank waits alike: each round is one broadcast from rank 0
                time.sleep(0.2)
                joiners = self._agree_on_joiners(p)
            if joiners is None:
                return None  # not enough joiners ready yet: ask again at the next boundary
            self.pending = None
            if joiners == "drop":
                self.prepared = None
                rank_zero_warn(f"scale-out to {p.target.short()} dropped: not enough joiners got ready within "
                               f"{strategy.elastic.config.join_timeout:.0f}s; training goes on with "
                               f"{strategy.world_size} processes")
                return None
            shrink = strategy.world_size - p.target.world_size + len(joiners)
            leaving = (f"ranks {sorted(p.leave)}" if p.leave else
                       f"{shrink} process(es) chosen by the planner" if shrink > 0 else "none")
            rank_zero_info(f"{change}: leaving {leaving}; admitting joiners {joiners or 'none'}")
            with self._refusable(p):
                return self.switch_world(p.target, p.leave, joiners)
            return None
        except (RuntimeError, TimeoutError) as e:
            if isinstance(e, SwitchVerificationError):
                raise
            # A peer that died, or a joiner that vanished, shows up as a collective or rendezvous timeout.
            raise WorldChangeError(
                f"{change} failed: a process of the job did not take part within the "
                f"{strategy.elastic.config.timeout:.0f}s elastic timeout (it died or hung); this process stops "
                f"instead of training on partial state. Restart from the last checkpoint. Cause: {e}"
            ) from e

    @contextmanager
    def _refusable(self, p: "_Pending"):
        """A request that fails to plan (every rank computes the same plan, so all fail alike) before any state
        moved is refused with a warning; training goes on on the current layout."""
        try:
            yield
        except ValueError as e:
            if self.released:
                raise
            rank_zero_warn(f"switch to {p.target.short()} refused, training goes on as "
                           f"{self.strategy.parallel_config.short()}: {e}")

    def _agree_on_joiners(self, p: "_Pending"):
        """Rank 0 reads the ready joiners from the store; every rank gets its decision (one broadcast)."""
        strategy = self.strategy
        need = p.target.world_size - (strategy.world_size - len(p.leave))
        if need <= 0:
            return []
        decision = None
        if strategy.global_rank == 0:
            manager = strategy.elastic
            ready = manager.ready_joiners()
            if len(ready) >= need:
                decision = ready[:need]
            elif time.monotonic() - p.requested_at > manager.config.join_timeout:
                for m in ready:
                    manager.drop_joiner(m, f"the scale-out to {p.target.short()} timed out")
                decision = "drop"
            if self.prepared is not None:
                self.prepared.publish(manager.store)
        decision = strategy.broadcast(decision)
        if decision is None:
            self._prepare(p)
        return decision

    def _change_inputs(self, target: ParallelConfig, leave, joiners: list[str] | None, captured=None
                       ) -> ChangeInputs:
        strategy = self.strategy
        if captured is None:
            captured = self.capture_states(strategy.lightning_module, self.optimizer())
        new_shardings, _ = self._target_shardings_of(target, captured, probe=True)
        return ChangeInputs.build(captured.specs, captured.shardings, new_shardings,
                                  strategy.parallel_config, strategy.positions, strategy.elastic.world.members, target,
                                  leave, joiners, strategy.rank_map, strategy.switch_budget_bytes)

    def _prepare(self, p: "_Pending") -> None:
        """While a scale-out waits for its joiners: plan it in the background, for whichever joiners come (see
        `prepare`)."""
        inputs = self._change_inputs(p.target, p.leave, None)
        if self.prepared is None or self.prepared.inputs != inputs:
            self.prepared = MemberPrep(inputs)

    # ---- the switch ---------------------------------------------------------------------------------------
    def switch(self, target: str | ParallelConfig, *, rank_map: str | None = None,
               budget_mb: float | None = None) -> SwitchReport:
        """A layout switch within the current world (same processes), for any module the strategy set up: the
        states are read from the live module and optimizer, the target from the module's own parallelisation."""
        self._require_boundary()
        timer = PhaseTimer()
        strategy = self.strategy
        target = self.check(target)
        module, optimizer, captured = self._capture_agreed()
        old_cfg, rank = strategy.parallel_config, strategy.global_rank
        budget = strategy.switch_budget_bytes if budget_mb is None else int(budget_mb * 2**20)
        old_layout = Layout.from_shardings(captured.specs, captured.shardings, old_cfg, rank_map=strategy.positions)
        target_layout, probe = self.target_layout(target, captured)
        plan, _ = plan_mesh_safe(
            lambda order: plan_switch(old_layout, target_layout, rank_map=order or rank_map or strategy.rank_map,
                                      budget_bytes=budget),
            lambda plan: list(plan.new.rank_map), target)
        validate_sources(plan, rank, captured.sources)
        timer.lap("plan")

        positions = list(plan.new.rank_map)
        new_mesh = strategy._build_mesh(target, ranks=positions)
        if probe is None or positions != list(range(target.world_size)):
            probe = strategy.build_target(new_mesh, target)
        timer.lap("build")

        old_sums = local_checksums(old_layout, rank, captured.sources) if strategy.verify_switches else None
        kept = self.keep_states(captured, optimizer)
        src = captured.sources
        names = self.release_module(module, optimizer)
        del optimizer, captured
        gc.collect()
        timer.lap("release")

        dst, stats = run_transition(plan, rank, src, device=strategy.root_device)
        del src
        timer.lap("transfer")

        self.adopt_module(probe, names, new_mesh, target, positions, dst, kept)
        timer.lap("adopt")

        verified = None
        if old_sums is not None:
            new_sums = local_checksums(plan.new, rank, capture(module, self.optimizer(), new_mesh).sources)
            verified = self._verified(compare(old_layout, old_sums, plan.new, new_sums, device=strategy.root_device),
                                      old_cfg, target)
            timer.lap("verify")
        release_freed_memory()
        return self._report(plan, old_cfg, target, positions, stats, verified, timer)

    def _capture_agreed(self):
        """(module, optimizer, captured states) of this rank, checked switchable and equal on every rank: one
        all-reduce of the specs' fingerprint before anything moves."""
        strategy = self.strategy
        module, optimizer = strategy.lightning_module, self.optimizer()
        check_switchable(module, strategy.optimizers)
        captured = self.capture_states(module, optimizer)
        if strategy.world_size > 1:
            self._agree_on(captured)
        return module, optimizer, captured

    def capture_states(self, module, optimizer):
        """This rank's states; under pp with every stage's specs and kept entries beside them (`merge_stages`)."""
        strategy = self.strategy
        captured = capture(module, optimizer, strategy.device_mesh)
        if strategy.parallel_config is None or strategy.parallel_config.pp == 1:
            return captured
        return merge_stages(captured, self._entry_order(optimizer))

    def _entry_order(self, optimizer) -> dict[str, list[str]]:
        """Per parameter name, its optimizer entries' keys in the order the optimizer created them."""
        names = self._param_names
        return {names[id(p)]: list(st) for p, st in optimizer.state.items()} if optimizer is not None else {}

    def _agree_on(self, captured) -> None:
        strategy = self.strategy
        mark = captured.fingerprint()
        t = torch.tensor([mark, -mark], dtype=torch.int64, device=strategy.root_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != mark or int(t[1]) != -mark:
            raise ValueError("the ranks hold different sets of states (names, shapes, dtypes or placements): a "
                             "module or optimizer that differs between ranks cannot be switched")

    def target_layout(self, target: ParallelConfig, captured, probe: bool = False):
        """The target layout of the captured states and, when there is one, the build to reuse (see
        `_target_shardings_of`)."""
        shardings, built = self._target_shardings_of(target, captured, probe)
        return Layout.from_shardings(captured.specs, shardings, target), built

    def _target_shardings_of(self, target: ParallelConfig, captured, probe: bool = False):
        """Per captured state, its sharding in ``target``, from the module's parallelisation run on meta (once per
        layout). Within the world it runs on the target's real mesh in the default rank order, and that build is
        returned for reuse when the plan keeps the order; for another world size (``probe``) on a mesh of fake
        groups (`probe`)."""
        strategy = self.strategy
        shardings = self._target_shardings.get(target)
        built = self._probes.pop(target, None) if shardings is not None and not probe else None
        if shardings is None:
            try:
                if probe or target.pp > 1:
                    # A pipeline's other stages are read from probes placed on them; nothing is built to reuse.
                    with ExitStack() as probes:
                        builds = [self._probe_build(probes, target, stage) for stage in range(target.pp)]
                        per_param = target_shardings(builds, captured)
                    built = None
                else:
                    mesh = strategy._build_mesh(target)
                    built = self._build(mesh, target)
                    per_param = target_shardings([(built, mesh)], captured)
            except _BuildFailed as e:
                cause = e.__cause__
                raise ValueError(f"the model's parallelisation failed for {target.short()} (run on the meta device): "
                                 f"{type(cause).__name__}: {cause}") from cause
            shardings = {captured.param_of[s.name][0]: sh for s, sh in zip(captured.specs, per_param)}
            self._target_shardings[target] = shardings
        try:
            return tuple(shardings[captured.param_of[s.name][0]] for s in captured.specs), built
        except KeyError as e:
            raise ValueError(f"state {e.args[0]!r} appeared after the target layout was built") from None

    def _probe_build(self, probes: ExitStack, target: ParallelConfig, stage: int):
        """(the module parallelised for ``target`` as pipeline stage ``stage`` sees it, its probe mesh); the probe's
        groups stay registered until ``probes`` closes."""
        mesh = probes.enter_context(probe_mesh(target, self.strategy.root_device.type, stage))
        build = self._build(mesh, target)
        if target.pp > 1 and pipeline_stages(build) is None:
            raise ValueError(f"{target.short()} asks for pipeline stages, but the module's parallelisation split no "
                             "model into stages (see docs/pipeline.md): use pp=1 for this module")
        return build, mesh

    def _build(self, mesh, target: ParallelConfig):
        try:
            return self.strategy.build_target(mesh, target)
        except Exception as e:
            raise _BuildFailed() from e

    def forget_builds(self) -> None:
        """Drop the meta builds made at request time: they hold this world's meshes, which a world change ends."""
        self._probes.clear()

    def keep_states(self, captured, optimizer) -> dict:
        """What survives a switch besides the routed shards: scalars, hyper-parameters, schedules."""
        return {
            "param_of": captured.param_of, "scalars": captured.scalars,
            "order": captured.order if captured.order is not None else self._entry_order(optimizer),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            if optimizer else [],
            "schedulers": [cfg.scheduler.state_dict() for cfg in self.strategy.lr_scheduler_configs],
        }

    @property
    def _param_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.strategy.lightning_module.named_parameters()}

    def release_module(self, module, optimizer) -> list[str]:
        """Drop every reference to the old shards but the engine's, so it can free each after its last send."""
        if optimizer is not None:
            optimizer.state.clear()
            for g in optimizer.param_groups:
                g["params"] = []
        self.strategy.optimizers = []
        self.released = True
        return release_children(module)

    def _restore_optimizer(self, module, dst, kept) -> None:
        strategy = self.strategy
        if self.trainer is None:
            return
        strategy.setup_optimizers(self.trainer)
        if not strategy.optimizers:
            return
        optimizer = strategy.optimizers[0]
        if len(optimizer.param_groups) != len(kept["groups"]):
            raise RuntimeError("configure_optimizers() returned different parameter groups after the switch")
        for group, old in zip(optimizer.param_groups, kept["groups"]):
            group.update(old)
        restore_optimizer(optimizer, module, dst, kept["param_of"], kept["scalars"], kept["order"])
        for cfg, state in zip(strategy.lr_scheduler_configs, kept["schedulers"]):
            cfg.scheduler.load_state_dict(state)

    def switch_world(self, target: ParallelConfig, leave: tuple[int, ...], joiners: list[str]) -> SwitchReport:
        """A switch that changes the processes: ``leave`` (current ranks) go, ``joiners`` (ready member ids) come.

        The plan runs over the union of old and new members (process id = rank in the union's sorted member
        list, which is what the union generation's ranks are); the new mesh is built on the target generation.
        """
        self._require_boundary()
        timer = PhaseTimer()
        strategy = self.strategy
        manager = strategy.elastic
        module, optimizer, captured = self._capture_agreed()
        old_cfg = strategy.parallel_config
        inputs = self._change_inputs(target, leave, joiners, captured)
        prepared, self.prepared = self.prepared, None
        if prepared is not None and prepared.inputs == inputs:
            world_plan = prepared.plan()
        else:
            world_plan, prepared = plan_world_change(inputs), None
        plan, old_layout = world_plan.plan, world_plan.old_layout
        target_members, target_ranks = world_plan.target_members(inputs.union), world_plan.target_ranks
        union = list(inputs.union)
        me = union.index(manager.member_id)
        src = captured.sources
        validate_sources(plan, me, src)
        timer.lap("plan")

        old_totals = None
        if strategy.verify_switches:
            old_totals = reduce_sums(local_checksums(old_layout, me, src), strategy.root_device)
        kept = self.keep_states(captured, optimizer)
        if joiners and strategy.global_rank == 0:
            manager.publish(manager.world.generation + 1, {
                **world_plan.intent(), "target_ranks": target_ranks, "union": union,
                "scalars": encode_scalars(kept["scalars"]), "groups": kept["groups"], "order": kept["order"],
                "param_of": kept["param_of"], "checkpoint": loop_checkpoint(self.trainer),
                "old_totals": old_totals, "loggers": logger_versions(self.trainer),
            })
        names = self.release_module(module, optimizer)
        self.forget_builds()
        del optimizer, captured
        gc.collect()
        timer.lap("release")

        moved: dict = {}
        # When nobody leaves, the transfer runs on the target generation itself: build the target mesh and model
        # before it, while the joiners run their Lightning set-up (see `join`), instead of after it.
        ahead = set(target_members) == set(union)

        def build(world) -> None:
            set_world(strategy, world.rank, world.world_size)
            strategy._meshes.clear()  # every group of the old generation is gone
            moved["mesh"] = mesh = strategy._build_mesh(target, ranks=target_ranks)
            moved["model"] = strategy.build_target(mesh, target)

        def transfer(world) -> None:
            if ahead:
                timer.lap("transfer")
                build(world)
                timer.lap("build")
            moved["dst"], moved["stats"] = run_transition(plan, me, src, group_ranks=_ranks_in(world, union),
                                                          device=strategy.root_device)

        # The engine empties `src` as it sends.
        world = manager.change_world(target_members, transfer, order=target_members)
        timer.lap("transfer")
        stats = moved["stats"]
        if world is None:
            self._detach()
            if strategy._template is not None:
                transplant(module, strategy._template.fresh(), names)
            return self._report(plan, old_cfg, target, [], stats, None, timer)
        if not ahead:
            build(world)
            timer.lap("build")
        self.adopt_module(moved.pop("model"), names, moved.pop("mesh"), target, target_ranks, moved.pop("dst"), kept)
        timer.lap("adopt")
        verified = None
        if old_totals is not None:
            new_totals = reduce_sums(local_checksums(plan.new, me, capture(module, self.optimizer(),
                                                                           strategy.device_mesh).sources),
                                     strategy.root_device)
            verified = self._verified(differing(old_layout, old_totals, plan.new, new_totals), old_cfg, target)
            timer.lap("verify")
        release_freed_memory()
        return self._report(plan, old_cfg, target, target_ranks, stats, verified, timer,
                            prepared=prepared is not None)

    def adopt_module(self, target_module, names, mesh, target: ParallelConfig, positions, dst, kept) -> None:
        """The target copy filled with the moved states and put in place of the live module's children; the
        optimizer, schedules and data then follow the new layout."""
        strategy = self.strategy
        module = strategy.lightning_module
        fill_target(target_module, names, dst, strategy.root_device)
        transplant(module, target_module, names)
        strategy._device_mesh = module._device_mesh = mesh
        strategy.parallel_config, strategy.positions = target, list(positions)
        self._restore_optimizer(module, dst, kept)
        strategy.build_pipeline()
        self._move_data(target)
        self.released = False

    # ---- a process joining a running job ------------------------------------------------------------------
    def join(self) -> None:
        """Register, wait for admission, receive this process's shards and enter the target world.

        Runs in `setup_environment`, before Lightning builds the model: the shards wait in `self.joined` for
        the strategy's set-up, the optimizer and Lightning's restore of the loop state. When nobody leaves, the
        transfer runs on the target generation and waits for the set-up instead: the joiner's Lightning set-up
        (data, the module's own parallelisation) then overlaps the members' build of the same mesh and model.
        """
        strategy = self.strategy
        manager = strategy.elastic
        manager.register_joiner(strategy.member_info())
        manager.mark_ready()
        prep = JoinerPrep(manager.store)
        t, payload = manager.await_admission(on_wait=prep.poll)
        plan, old_layout = prep.plan_for(payload) or plan_from_payload(payload)
        target = ParallelConfig.parse(payload["target"])
        me = payload["union"].index(manager.member_id)
        moved: dict = {}

        def transfer(world) -> dict:
            moved["dst"], moved["stats"] = run_transition(plan, me, {}, group_ranks=_ranks_in(world, payload["union"]),
                                                          device=strategy.root_device)
            return moved["dst"]

        ahead = set(t.new) == set(t.union)  # as `switch_world` decides it
        world = manager.join_world(t, None if ahead else transfer)
        set_world(strategy, world.rank, world.world_size)
        strategy.parallel_config = target
        strategy.positions = list(payload["target_ranks"])
        strategy._device_mesh = strategy._build_mesh(target, ranks=strategy.positions)
        adopt_logger_versions(self.trainer or strategy.lightning_module.trainer, payload["loggers"])
        self.joined = JoinState(
            dst=moved.get("dst"), receive=(lambda: transfer(world)) if ahead else None,
            scalars=decode_scalars(payload["scalars"], strategy.root_device),
            groups=payload["groups"], checkpoint=payload["checkpoint"], old_totals=payload["old_totals"],
            old_layout=old_layout, new_layout=plan.new, process=me,
            param_of={k: (v[0], v[1]) for k, v in payload["param_of"].items()}, order=payload["order"],
        )

    def receive_joined(self) -> None:
        """A joiner whose transfer waited for Lightning's set-up: receive its shards now (once)."""
        joined = self.joined
        if joined is not None and joined.receive is not None:
            receive, joined.receive = joined.receive, None
            joined.dst = receive()

    def adopt_joined_module(self) -> None:
        """A joiner, after its module's own parallelisation for the target layout: the received shards in place."""
        self.receive_joined()
        module = self.strategy.lightning_module
        fill_target(module, param_children(module), self.joined.dst, self.strategy.root_device)

    def adopt_joined_optimizer(self) -> None:
        """After `setup_optimizers`: optimizer state and hyper-parameters as the members had them; then verify."""
        joined, strategy = self.joined, self.strategy
        module, optimizer = strategy.lightning_module, self.optimizer()
        if optimizer is not None:
            for group, old in zip(optimizer.param_groups, joined.groups):
                group.update(old)
            restore_optimizer(optimizer, module, joined.dst, joined.param_of, joined.scalars, joined.order)
        if joined.old_totals is not None:
            new_totals = reduce_sums(local_checksums(joined.new_layout, joined.process,
                                                     capture(module, optimizer, strategy.device_mesh).sources),
                                     strategy.root_device)
            self._verified(differing(joined.old_layout, joined.old_totals, joined.new_layout, new_totals),
                           joined.old_layout.config, strategy.parallel_config)

    def on_train_start(self) -> None:
        """A joiner, after Lightning restored the loop state (its schedulers were stepped before the switch, as
        Lightning steps them before `on_train_batch_end`): lay out the data as the members did."""
        if self.joined is None:
            return
        self.joined = None
        strategy = self.strategy
        self._move_data(strategy.parallel_config)
        strategy.local_only = False

    # ---- parts shared by the switches ---------------------------------------------------------------------
    def _require_boundary(self) -> None:
        if not self.at_boundary():
            raise RuntimeError(
                "a layout switch can only run at an optimizer-step boundary: use strategy.request_switch(), "
                "which waits for the end of the current gradient accumulation"
            )
        for guard in self.strategy.switch_guards:
            guard()

    def optimizer(self):
        return self.strategy.optimizers[0] if self.strategy.optimizers else None

    def _verified(self, bad: list[str], old_cfg: ParallelConfig, target: ParallelConfig) -> bool:
        if bad:
            raise SwitchVerificationError(
                f"switch {old_cfg.short()} -> {target.short()} changed {len(bad)} state(s), e.g. {bad[:5]}"
            )
        return True

    def _detach(self) -> None:
        """A process that left: no model, no group; Lightning winds its loop down without collectives."""
        strategy = self.strategy
        strategy.detached = True
        strategy.elastic.stop_heartbeat()
        strategy._meshes.clear()
        strategy._device_mesh = None
        if self.trainer is not None:
            self.trainer.should_stop = True
        rank_zero_only.rank = fabric_rank_zero_only.rank = -1  # this process logs nothing more

    def _report(self, plan, old_cfg, target, positions, stats, verified, timer, prepared=False) -> SwitchReport:
        strategy = self.strategy
        report = SwitchReport(
            step=self.trainer.global_step if self.trainer else 0,
            old_layout=old_cfg.short(), new_layout=target.short(),
            world_size=target.world_size if not getattr(strategy, "detached", False) else 0,
            bytes_total=plan.bytes_total, bytes_moved=plan.bytes_moved,
            bytes_moved_identity=plan.bytes_moved_identity, rounds=plan.num_rounds, rank_map=list(positions),
            peak_bytes=stats.peak_bytes, peak_bound=stats.peak_bound, verified=verified, phases=timer.phases,
            old_world_size=old_cfg.world_size, prepared=prepared,
        )
        strategy.switch_reports.append(report)
        rank_zero_info(
            f"layout switch {report.old_layout} -> {report.new_layout} at step {report.step}: "
            f"{report.bytes_moved / 2**20:.1f} MiB moved of {report.bytes_total / 2**20:.1f} MiB, "
            f"stall {report.stall_s:.3f}s" + (", verified bitwise" if verified else "")
        )
        for hook in strategy.after_switch:
            hook(report)
        return report

    def _move_data(self, target: ParallelConfig) -> None:
        trainer = self.trainer
        if trainer is None:
            return
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "set_layout"):
            trainer.accumulate_grad_batches = datamodule.set_layout(target.dp_size, self.strategy.dp_rank)
        loop = trainer.fit_loop.epoch_loop
        self.accumulation_offset = loop.batch_progress.current.ready
        sampler = getattr(datamodule, "train_sampler", None)
        if sampler is not None and hasattr(sampler, "remaining_in_epoch") and trainer.training:
            # The epoch now has a different number of micro-batches per rank.
            micro = getattr(datamodule, "micro_batch_size", 1)
            trainer.fit_loop.max_batches = self.accumulation_offset + sampler.remaining_in_epoch() // micro


def _ranks_in(world, union: list[str]) -> dict[int, int]:
    """Plan process id (index in the sorted union) -> rank in ``world``."""
    return {p: world.members.index(m) for p, m in enumerate(union) if m in world.members}
