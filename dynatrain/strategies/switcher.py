"""`Switcher`: runs a layout switch for `DynaTrainStrategy`, only at optimizer-step boundaries.

Order of a switch (every rank runs the same steps on the same inputs, so every collective matches):
check the target (nothing has moved: a bad target leaves training untouched) -> plan (pure, identical on
every rank) -> build the new mesh (same group calls in the same order everywhere) and the new model on meta ->
run the transfer -> materialise the new model and adopt weights, Adam moments, step, LR schedule, data position
and gradient accumulation -> optionally verify bitwise.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from dynatrain.engine.transition import run_transition, validate_sources
from dynatrain.engine.verify import SwitchVerificationError, compare, local_checksums
from dynatrain.models.llama import Transformer
from dynatrain.models.parallelize import allocate_model, mesh_safe
from dynatrain.planner.schedule import plan_switch
from dynatrain.strategies.switch import (
    PhaseTimer,
    SwitchReport,
    adopt_weights,
    collect_sources,
    install_optimizer_state,
    scalar_states,
    state_specs,
)
from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig

if TYPE_CHECKING:
    from dynatrain.strategies.dynatrain import DynaTrainStrategy


class _BoundaryHook(pl.Callback):
    """Runs a requested switch right after the micro-batch that closed an optimizer step."""

    def __init__(self, switcher: "Switcher") -> None:
        self.switcher = switcher

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.switcher.accumulation_offset = 0  # Lightning's batch counter restarts with each epoch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.switcher.pending is not None and self.switcher.at_boundary():
            target, self.switcher.pending = self.switcher.pending, None
            self.switcher.switch(target)


class Switcher:
    def __init__(self, strategy: "DynaTrainStrategy") -> None:
        self.strategy = strategy
        self.pending: ParallelConfig | None = None
        self.accumulation_offset = 0
        self.trainer: pl.Trainer | None = None

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

            def zero_grad_fn() -> None:
                auto._on_before_zero_grad(optimizer)
                auto._optimizer_zero_grad(batch_idx, optimizer)

            return zero_grad_fn

        auto._make_zero_grad_fn = make_zero_grad_fn

    def at_boundary(self) -> bool:
        trainer = self.trainer
        if trainer is None or not trainer.training:
            return True
        loop = trainer.fit_loop.epoch_loop
        done = loop.batch_progress.current.ready - self.accumulation_offset
        return done % trainer.accumulate_grad_batches == 0

    # ---- requests -----------------------------------------------------------------------------------------
    def check(self, target: str | ParallelConfig) -> ParallelConfig:
        """Parse and validate a target against the devices, the model and the global batch."""
        strategy = self.strategy
        target = ParallelConfig.parse(target).validate(strategy.model_config(), strategy.world_size)
        datamodule = getattr(self.trainer, "datamodule", None) if self.trainer else None
        if datamodule is not None and hasattr(datamodule, "accumulation_for"):
            try:
                datamodule.accumulation_for(target.dp_size)
            except ValueError as e:
                raise ValueError(f"cannot switch to {target.short()}: {e}") from None
        return target

    def request(self, target: str | ParallelConfig) -> ParallelConfig:
        target = self.check(target)
        self.pending = target
        if self.trainer is None or not self.trainer.training:
            self.pending = None
            self.switch(target)
        return target

    # ---- the switch ---------------------------------------------------------------------------------------
    def switch(self, target: str | ParallelConfig, *, rank_map: str | None = None,
               budget_mb: float | None = None) -> SwitchReport:
        if not self.at_boundary():
            raise RuntimeError(
                "a layout switch can only run at an optimizer-step boundary: use strategy.request_switch(), "
                "which waits for the end of the current gradient accumulation"
            )
        timer = PhaseTimer()
        strategy = self.strategy
        module = strategy.lightning_module
        target = self.check(target)
        model = getattr(module, "model", None)
        if not isinstance(model, Transformer):
            raise TypeError("switch() moves a dynatrain Transformer held as `model` by the LightningModule; "
                            f"found {type(model).__name__}")
        optimizer = strategy.optimizers[0] if strategy.optimizers else None
        old_cfg, rank = strategy.parallel_config, strategy.global_rank
        budget = strategy.switch_budget_bytes if budget_mb is None else int(budget_mb * 2**20)

        specs = state_specs(model, optimizer)
        old_layout = Layout.from_config(specs, old_cfg, rank_map=strategy.positions)
        plan = plan_switch(old_layout, target, rank_map=rank_map or strategy.rank_map, budget_bytes=budget)
        if not mesh_safe(plan.new.rank_map, target):
            # Within one world, mesh groups keep sorted ranks: take the best arrangement they can express.
            plan = plan_switch(old_layout, target, rank_map="identity", budget_bytes=budget)
        src = collect_sources(model, optimizer)
        validate_sources(plan, rank, src)
        timer.lap("plan")

        positions = list(plan.new.rank_map)
        new_mesh = strategy._build_mesh(target, ranks=positions)
        new_model = strategy.meta_model(model.config, new_mesh, target)
        timer.lap("build")

        old_sums = local_checksums(old_layout, rank, src) if strategy.verify_switches else None
        scalars = scalar_states(model, optimizer)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else []
        schedulers = [cfg.scheduler.state_dict() for cfg in strategy.lr_scheduler_configs]
        # Drop every reference to the old shards but the engine's, so it can free each after its last send.
        module.model = None
        if optimizer is not None:
            optimizer.state.clear()
            for g in optimizer.param_groups:
                g["params"] = []
        strategy.optimizers = []
        del model, optimizer
        gc.collect()
        timer.lap("release")

        dst, stats = run_transition(plan, rank, src, device=strategy.root_device)
        del src
        timer.lap("transfer")

        allocate_model(new_model, strategy.root_device)
        adopt_weights(new_model, dst)
        module.model = new_model
        strategy._device_mesh = new_mesh
        module._device_mesh = new_mesh
        strategy.parallel_config = target
        strategy.positions = positions
        self._rebuild_optimizer(new_model, dst, scalars, groups, schedulers)
        self._move_data(target)
        timer.lap("adopt")

        verified = None
        if old_sums is not None:
            new_opt = strategy.optimizers[0] if strategy.optimizers else None
            new_sums = local_checksums(plan.new, rank, collect_sources(new_model, new_opt))
            bad = compare(old_layout, old_sums, plan.new, new_sums, device=strategy.root_device)
            if bad:
                raise SwitchVerificationError(
                    f"switch {old_cfg.short()} -> {target.short()} changed {len(bad)} state(s), e.g. {bad[:5]}"
                )
            verified = True
            timer.lap("verify")
        gc.collect()

        report = SwitchReport(
            step=self.trainer.global_step if self.trainer else 0,
            old_layout=old_cfg.short(), new_layout=target.short(), world_size=strategy.world_size,
            bytes_total=plan.bytes_total, bytes_moved=plan.bytes_moved,
            bytes_moved_identity=plan.bytes_moved_identity, rounds=plan.num_rounds, rank_map=positions,
            peak_bytes=stats.peak_bytes, peak_bound=stats.peak_bound, verified=verified, phases=timer.phases,
        )
        strategy.switch_reports.append(report)
        rank_zero_info(
            f"layout switch {report.old_layout} -> {report.new_layout} at step {report.step}: "
            f"{report.bytes_moved / 2**20:.1f} MiB moved of {report.bytes_total / 2**20:.1f} MiB, "
            f"stall {report.stall_s:.3f}s" + (", verified bitwise" if verified else "")
        )
        return report

    def _rebuild_optimizer(self, model, dst, scalars, groups, schedulers) -> None:
        strategy = self.strategy
        if self.trainer is None:
            return
        strategy.setup_optimizers(self.trainer)
        if not strategy.optimizers:
            return
        optimizer = strategy.optimizers[0]
        if len(optimizer.param_groups) != len(groups):
            raise RuntimeError("configure_optimizers() returned different parameter groups after the switch")
        for group, old in zip(optimizer.param_groups, groups):
            group.update(old)
        install_optimizer_state(model, optimizer, dst, scalars)
        for cfg, state in zip(strategy.lr_scheduler_configs, schedulers):
            cfg.scheduler.load_state_dict(state)

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
