"""Lightning's fit loop kept in step with layout switches, the one place that touches the loop's internals: a
requested switch runs right after the micro-batch that closed an optimizer step; after a switch changes the gradient
accumulation mid-epoch, steps are counted from the switch; in an elastic job, a process lost during a micro-batch is
recovered from; after the data split changes, the epoch's length is set wherever Lightning measured it.

Lightning has no public hook for any of these: none to run code between two micro-batches after every
``on_train_batch_end`` (a callback's is not last), to say when an accumulation closes (it is ``batch_idx %
accumulate_grad_batches`` inside the loop), to retry a micro-batch after a collective failed, or to re-measure an
epoch mid-way. Lightning's internals outside the loop are reached through `lightning_internals`. What is touched,
and the Lightning versions this runs with, is in docs/lightning.md.
"""

from __future__ import annotations

from typing import Any, Protocol

import lightning.pytorch as pl

from dynatrain.check.verify import SwitchVerificationError
from dynatrain.strategies.pool_notice import WorkingMemoryNotice
from dynatrain.switch.recovery import WorldChangeError, is_peer_loss


class Switching(Protocol):
    """What the loop needs of the strategy's switch orchestrator (`switch_orchestrator`)."""

    strategy: Any
    pending: Any
    accumulation_offset: int

    @property
    def trainer(self) -> pl.Trainer | None: ...

    @property
    def released(self) -> bool: ...

    def run_pending(self) -> Any: ...

    def recover(self, error: BaseException) -> Any: ...

    def on_train_start(self) -> None: ...


class BoundaryHook(pl.Callback):
    """Keeps the switch orchestrator in step with Lightning's epochs and start; a requested switch runs right after the
    micro-batch that closed an optimizer step (see `_wrap_advance`)."""

    def __init__(self, switching: Switching) -> None:
        self.switching = switching

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # Lightning's batch counter restarts with each epoch (a resumed one goes on from `on_train_start`'s count).
        if not self.switching.strategy.data_split.on_epoch_start(trainer):
            self.switching.accumulation_offset = 0

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning does not announce an epoch it resumes in the middle of: here it goes on from the saved count.
        if self.switching.strategy.data_split.on_train_start(trainer):
            self.switching.accumulation_offset = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        self.switching.on_train_start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.switching.strategy.data_split.check_batch(trainer, batch)

    def state_dict(self) -> dict:
        # The data's position within its epoch: in every checkpoint, and what a joiner receives.
        return self.switching.strategy.data_split.state_dict(self.switching.trainer)

    def load_state_dict(self, state_dict: dict) -> None:
        self.switching.strategy.data_split.load_state_dict(state_dict)


def attach(switching: Switching, trainer: pl.Trainer) -> None:
    if not any(isinstance(cb, BoundaryHook) for cb in trainer.callbacks):
        trainer.callbacks.append(BoundaryHook(switching))
    loop = trainer.fit_loop.epoch_loop
    # Lightning closes a step when (micro-batches this epoch) % accumulation == 0; after a switch changes the
    # accumulation mid-epoch, count from the switch instead so steps stay whole.
    loop._accumulated_batches_reached = lambda: (
        (loop.batch_progress.current.ready - switching.accumulation_offset) % trainer.accumulate_grad_batches == 0
    )
    # The same for zeroing gradients, which Lightning keys on batch_idx % accumulation.
    auto = loop.automatic_optimization

    def make_zero_grad_fn(batch_idx: int, optimizer):
        if auto._skip_backward or (batch_idx - switching.accumulation_offset) % trainer.accumulate_grad_batches:
            return None
        if switching.strategy.pipeline is not None:
            # Lightning zeroes between a micro-batch's step and its backward; a pipeline's backward ran inside
            # the step, so the strategy zeroes before the schedule instead.
            return None

        def zero_grad_fn() -> None:
            auto._on_before_zero_grad(optimizer)
            auto._optimizer_zero_grad(batch_idx, optimizer)

        return zero_grad_fn

    auto._make_zero_grad_fn = make_zero_grad_fn
    _wrap_advance(switching, loop)


def _wrap_advance(switching: Switching, loop) -> None:
    """Around each micro-batch: a pending switch runs once the micro-batch that closed a step is done; in an
    elastic job, a process lost during a micro-batch is recovered from (see `recovery`), the micro-batch then
    counts as consumed and its step runs again under the survivors' layout."""
    advance, advance_end = loop.advance, loop.on_advance_end
    skip_end = [False]
    notice = WorkingMemoryNotice(switching.strategy)

    def guarded_advance(data_fetcher) -> None:
        try:
            advance(data_fetcher)
        except Exception as e:
            if not _recoverable(switching, e):
                raise
            error = e
        else:
            # After every on_train_batch_end, the LightningModule's included: what the module does at the end
            # of a step (a buffer it updates, say) is part of the state that moves.
            if at_boundary(switching):
                notice.at_step_end()
                if switching.pending is not None:
                    switching.run_pending()
            return
        # Outside the handler, without the traceback: its frames hold the step's tensors, which hold the
        # broken groups open.
        error.__traceback__ = None
        switching.recover(error)
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


def _recoverable(switching: Switching, error: BaseException) -> bool:
    strategy = switching.strategy
    if strategy.elastic is None or not strategy.elastic.config.recover or strategy.detached:
        return False
    if isinstance(error, (WorldChangeError, SwitchVerificationError)) or not is_peer_loss(error):
        return False
    return not switching.released  # a switch that began moving state cannot be undone


def at_boundary(switching: Switching) -> bool:
    """True between two optimizer steps (or outside training)."""
    trainer = switching.trainer
    if trainer is None or not trainer.training:
        return True
    loop = trainer.fit_loop.epoch_loop
    done = loop.batch_progress.current.ready - switching.accumulation_offset
    return done % trainer.accumulate_grad_batches == 0


def accumulating(trainer: pl.Trainer) -> bool:
    """True while the micro-batch Lightning hands over does not close an optimizer step."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


# ---- the epoch's data, as the loop measured it ----------------------------------------------------------------
def micro_batches_done(trainer: pl.Trainer) -> int:
    """Micro-batches this epoch has read."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready


def stage_loaders(trainer: pl.Trainer, training: bool) -> list:
    """The loaders Lightning iterates in the training (or validation) stage now; [] before it loaded them."""
    loop = trainer.fit_loop if training else trainer.fit_loop.epoch_loop.val_loop
    combined = loop._combined_loader
    return [] if combined is None else list(combined.flattened)


def set_epoch_length(trainer: pl.Trainer, lengths: list[int]) -> None:
    """Micro-batches of each training loader in the running epoch, wherever Lightning measured them: the loop's
    bound, the combined loader's limits (also those its running iterator began with) and the fetcher's length."""
    fit = trainer.fit_loop
    combined = fit._combined_loader
    if len(lengths) == len(combined.flattened):
        combined.limits = lengths
        if combined._iterator is not None:
            combined._iterator.limits = lengths
    # As the combined loader's mode counts them (Lightning's own default, "max_size_cycle", the longest).
    fit.max_batches = min(lengths) if combined._mode == "min_size" else max(lengths)
    if fit._data_fetcher is not None and fit._data_fetcher.length is not None:
        fit._data_fetcher.length = fit.max_batches


def set_val_lengths(trainer: pl.Trainer, lengths: list[int]) -> None:
    """Batches of each validation loader, when Lightning has loaded as many."""
    val = trainer.fit_loop.epoch_loop.val_loop
    if val._combined_loader is not None and len(val._max_batches) == len(lengths):
        val._max_batches = list(lengths)


def restart_fetcher(trainer: pl.Trainer) -> None:
    """Start the training loaders' iterator again (their workers read ahead under the old split), keeping the
    count of what was fetched."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None:
        return
    fetched = fetcher.fetched
    iter(fetcher)
    fetcher.fetched = fetched


def resume_from_when_none(trainer: pl.Trainer, path: str) -> None:
    """Make this fit restore from ``path`` when it was given no ``ckpt_path``: a joiner started by a launcher that
    runs the user's own script (torchrun) must resume the loop state the members hand it, and the script's
    ``trainer.fit(model)`` names none. Lightning fixed the path before the strategy's set-up runs; what reads it is
    the checkpoint connector's restore of modules and callbacks."""
    connector = trainer._checkpoint_connector
    restore = connector._restore_modules_and_callbacks

    def restore_with_default(checkpoint_path=None, *args, **kwargs):
        return restore(checkpoint_path or path, *args, **kwargs)

    connector._restore_modules_and_callbacks = restore_with_default
