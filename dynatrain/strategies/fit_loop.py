"""Lightning's fit loop kept in step with layout switches: a requested switch runs right after the micro-batch
that closed an optimizer step; after a switch changes the gradient accumulation mid-epoch, steps are counted
from the switch; in an elastic job, a process lost during a micro-batch is recovered from (see `recovery`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning.pytorch as pl

from dynatrain.engine.verify import SwitchVerificationError
from dynatrain.strategies.recovery import WorldChangeError, is_peer_loss, recover

if TYPE_CHECKING:
    from dynatrain.strategies.switcher import Switcher


class BoundaryHook(pl.Callback):
    """Keeps the switcher in step with Lightning's epochs and start; a requested switch runs right after the
    micro-batch that closed an optimizer step (see `_wrap_advance`)."""

    def __init__(self, switcher: "Switcher") -> None:
        self.switcher = switcher

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # Lightning's batch counter restarts with each epoch (a resumed one goes on from `on_train_start`'s count).
        if not self.switcher.strategy.data_split.on_epoch_start(trainer):
            self.switcher.accumulation_offset = 0

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning does not announce an epoch it resumes in the middle of: here it goes on from the saved count.
        if self.switcher.strategy.data_split.on_train_start(trainer):
            self.switcher.accumulation_offset = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        self.switcher.on_train_start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.switcher.strategy.data_split.check_batch(trainer, batch)

    def state_dict(self) -> dict:
        # The data's position within its epoch: in every checkpoint, and what a joiner receives.
        return self.switcher.strategy.data_split.state_dict(self.switcher.trainer)

    def load_state_dict(self, state_dict: dict) -> None:
        self.switcher.strategy.data_split.load_state_dict(state_dict)


def attach(switcher: "Switcher", trainer: pl.Trainer) -> None:
    switcher.trainer = trainer
    if not any(isinstance(cb, BoundaryHook) for cb in trainer.callbacks):
        trainer.callbacks.append(BoundaryHook(switcher))
    loop = trainer.fit_loop.epoch_loop
    # Lightning closes a step when (micro-batches this epoch) % accumulation == 0; after a switch changes the
    # accumulation mid-epoch, count from the switch instead so steps stay whole.
    loop._accumulated_batches_reached = lambda: (
        (loop.batch_progress.current.ready - switcher.accumulation_offset) % trainer.accumulate_grad_batches == 0
    )
    # The same for zeroing gradients, which Lightning keys on batch_idx % accumulation.
    auto = loop.automatic_optimization

    def make_zero_grad_fn(batch_idx: int, optimizer):
        if auto._skip_backward or (batch_idx - switcher.accumulation_offset) % trainer.accumulate_grad_batches:
            return None
        if switcher.strategy.pipeline is not None:
            # Lightning zeroes between a micro-batch's step and its backward; a pipeline's backward ran inside
            # the step, so the strategy zeroes before the schedule instead.
            return None

        def zero_grad_fn() -> None:
            auto._on_before_zero_grad(optimizer)
            auto._optimizer_zero_grad(batch_idx, optimizer)

        return zero_grad_fn

    auto._make_zero_grad_fn = make_zero_grad_fn
    _wrap_advance(switcher, loop)


def _wrap_advance(switcher: "Switcher", loop) -> None:
    """Around each micro-batch: a pending switch runs once the micro-batch that closed a step is done; in an
    elastic job, a process lost during a micro-batch is recovered from (see `recovery`), the micro-batch then
    counts as consumed and its step runs again under the survivors' layout."""
    advance, advance_end = loop.advance, loop.on_advance_end
    skip_end = [False]

    def guarded_advance(data_fetcher) -> None:
        try:
            advance(data_fetcher)
        except Exception as e:
            if not _recoverable(switcher, e):
                raise
            error = e
        else:
            # After every on_train_batch_end, the LightningModule's included: what the module does at the end
            # of a step (a buffer it updates, say) is part of the state that moves.
            if switcher.pending is not None and at_boundary(switcher):
                switcher.run_pending()
            return
        # Outside the handler, without the traceback: its frames hold the step's tensors, which hold the
        # broken groups open.
        error.__traceback__ = None
        recover(switcher, error)
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


def _recoverable(switcher: "Switcher", error: BaseException) -> bool:
    strategy = switcher.strategy
    if strategy.elastic is None or not strategy.elastic.config.recover or strategy.detached:
        return False
    if isinstance(error, (WorldChangeError, SwitchVerificationError)) or not is_peer_loss(error):
        return False
    return not switcher.released  # a switch that began moving state cannot be undone


def at_boundary(switcher: "Switcher") -> bool:
    """True between two optimizer steps (or outside training)."""
    trainer = switcher.trainer
    if trainer is None or not trainer.training:
        return True
    loop = trainer.fit_loop.epoch_loop
    done = loop.batch_progress.current.ready - switcher.accumulation_offset
    return done % trainer.accumulate_grad_batches == 0
