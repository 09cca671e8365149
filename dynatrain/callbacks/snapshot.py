"""`Snapshot`: asynchronous, atomic DCP snapshots of model + optimizer + loop state every N optimizer steps.

Layout on disk (``dirpath``)::

    step-20.partial/    being written (or left by a crash): never loaded, removed at the next commit
    step-10/            DCP shards + .metadata + snapshot.json (loop state, layout) + COMMITTED
    latest              "step-10", replaced atomically after each commit

A snapshot is started at an optimizer-step boundary into ``step-<N>.partial/``: the state is copied at once,
then written by a background thread (`dcp.async_save` on a gloo group of its own, so its collectives never
interleave with training's). At each later boundary the ranks agree with one tiny all_reduce whether every
write has finished; if so, rank 0 writes the ``COMMITTED`` marker and renames the directory, so a snapshot
appears in one atomic rename, complete or not at all, and broadcasts the outcome. At most one snapshot is in
flight; a layout switch (through ``strategy.switch_guards``) and the end of training finish it first.
``latest_snapshot`` and ``restore_snapshot`` only accept committed snapshots.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from dynatrain.strategies.loop_state import loop_checkpoint

log = logging.getLogger("dynatrain.snapshot")

from dynatrain.strategies.snapshot_io import (  # noqa: F401  (part of this module's public API)
    LATEST,
    MARKER,
    META,
    PARTIAL_NAME,
    SNAPSHOTS_KEY,
    STEP_NAME,
    committed_steps,
    is_committed,
    latest_snapshot,
    restore_snapshot,
    state_module,
)


# ---- writing snapshots ---------------------------------------------------------------------------------------
class _InFlight:
    def __init__(self, step: int, partial: Path, future: Future, started: float) -> None:
        self.step, self.partial, self.future, self.started = step, partial, future, started
        self.warned = False

    def error(self) -> BaseException | None:
        """Wait for the write; its exception (warned about once) or None."""
        e = self.future.exception()
        if e is not None and not self.warned:
            self.warned = True
            warnings.warn(f"snapshot of step {self.step} failed to write on rank {_rank()}: "
                          f"{type(e).__name__}: {e}", stacklevel=3)
        return e


class Snapshot(pl.Callback):
    """Save model, optimizer and loop state every ``every_n_steps`` optimizer steps, committing atomically.

    Args:
        every_n_steps: a snapshot at every optimizer step that is a multiple of this (at most that many steps
            are lost on a failure, plus the one or two steps a write takes to commit).
        dirpath: where snapshots go; default ``<trainer.default_root_dir>/snapshots``.
        keep: committed snapshots kept (the newest); older ones are deleted after each commit.
        async_save: write in a background thread (`dcp.async_save`); False writes synchronously at the boundary.

    ``history`` records, per snapshot of this process: step, whether it was committed, what finished it
    (``poll``: a later boundary found it done; ``due``: the next snapshot was due; ``switch``: a layout switch;
    ``end``; ``exception``), whether training had to wait for it, and seconds from start to commit.
    """

    def __init__(self, every_n_steps: int, dirpath: str | os.PathLike | None = None, keep: int = 2,
                 async_save: bool = True) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"Snapshot(every_n_steps={every_n_steps!r}): give a positive whole number of "
                             "optimizer steps between snapshots, e.g. every_n_steps=10")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Snapshot(keep={keep!r}): keep at least 1 committed snapshot, e.g. keep=2")
        self.every_n_steps = every_n_steps
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.keep = keep
        self.async_save = bool(async_save) and hasattr(dcp, "async_save")
        self.history: list[dict] = []
        self._inflight: _InFlight | None = None
        self._seen_step = -1
        self._strategy = None
        self._pg = None  # our own group: the background writer's collectives must not interleave with training's
        self._pg_key = None

    # ---- Lightning hooks ----------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "snapshots"
        self._strategy = trainer.strategy
        manager = getattr(trainer.strategy, "elastic", None)
        if manager is not None and trainer.global_rank == 0:
            # Where an elastic launcher finds the snapshot to restart the job from after an unrecoverable fault.
            manager.store.set(SNAPSHOTS_KEY, str(Path(self.dirpath).resolve()))
        guards = getattr(trainer.strategy, "switch_guards", None)
        if guards is not None and self._guard not in guards:
            guards.append(self._guard)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step  # a resumed or joining process does not re-save where it starts

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._detached() or not self._at_new_boundary(trainer):
            return
        step = trainer.global_step
        due = step % self.every_n_steps == 0
        if self._inflight is not None:
            self._finish(wait=due, by="due" if due else "poll")
        if due:
            self._start(trainer, pl_module, step)
            if not self.async_save:
                self._finish(wait=True, by="due")

    def on_train_end(self, trainer, pl_module) -> None:
        if not self._detached():
            self._finish(wait=True, by="end")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._finish_alone()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._finish_alone()
        guards = getattr(trainer.strategy, "switch_guards", None)
        if guards is not None and self._guard in guards:
            guards.remove(self._guard)
        self._pg = self._pg_key = None

    def _guard(self) -> None:
        """Before a layout switch moves state: its teardown of groups must not meet our background collectives."""
        if not self._detached():
            self._finish(wait=True, by="switch")

    # ---- start --------------------------------------------------------------------------------------------
    def _detached(self) -> bool:
        return bool(getattr(self._strategy, "detached", False))

    def _at_new_boundary(self, trainer) -> bool:
        if trainer.global_step == self._seen_step:
            return False  # the other micro-batches of an accumulated step
        at_boundary = getattr(trainer.strategy, "at_step_boundary", None)
        if at_boundary is not None and not at_boundary():
            return False
        self._seen_step = trainer.global_step
        return True

    def _group(self):
        """A gloo group of the current world, made again after a world change (every rank at the same step,
        so the group-creation sequence stays identical on all ranks)."""
        if not dist.is_initialized():
            return None
        elastic = getattr(self._strategy, "elastic", None)
        key = (elastic.world.generation if elastic is not None and elastic.world is not None else 0,
               dist.get_world_size())
        if key != self._pg_key:
            # The world's timeout (an elastic job's own); a strategy without one leaves torch's default.
            self._pg = dist.new_group(backend="gloo", timeout=getattr(self._strategy, "group_timeout", None))
            self._pg_key = key
        return self._pg

    def _start(self, trainer, pl_module, step: int) -> None:
        strategy = trainer.strategy
        partial = self.dirpath / f"step-{step}.partial"
        if trainer.global_rank == 0:
            layout = getattr(strategy, "parallel_config", None)
            partial.mkdir(parents=True, exist_ok=True)
            (partial / MARKER).unlink(missing_ok=True)  # a leftover of an earlier run at this step
            (partial / META).write_text(json.dumps({
                "step": step, "epoch": trainer.current_epoch, "world_size": trainer.world_size,
                "layout": layout.short() if layout is not None else None, "time": time.time(),
                "checkpoint": loop_checkpoint(trainer),
            }))
        msd, osd = get_state_dict(state_module(pl_module), list(strategy.optimizers))
        state = {"model": msd, "optim": osd}
        pg, started = self._group(), time.monotonic()
        if self.async_save:
            # Staging copies every tensor now, in this thread: the optimizer may change the originals at once.
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=pg)
        else:
            future = Future()
            try:
                future.set_result(dcp.save(state, checkpoint_id=str(partial), process_group=pg))
            except (Exception, dcp.CheckpointException) as e:  # the same on every rank: as an async failure
                future.set_exception(e)
        self._inflight = _InFlight(step, partial, future, started)

    # ---- finish and commit --------------------------------------------------------------------------------
    def _finish(self, wait: bool, by: str) -> None:
        """Commit the in-flight snapshot once every rank's write is done; with ``wait``, block until it is.

        Every rank calls this at the same points with the same in-flight state, so the all_reduce matches."""
        s = self._inflight
        if s is None:
            return
        waited = wait and not s.future.done()
        if waited:
            log.debug("snapshot of step %d still being written at a %s boundary: waiting for it", s.step, by)
        done = wait or s.future.done()
        ok = done and s.error() is None  # error() waits
        flags = torch.tensor([int(done), int(ok)], device=getattr(self._strategy, "root_device", None))
        if dist.is_initialized():
            # On the default group: in step with training's collectives, never mixed with the writer's.
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if not flags[0]:
            return
        self._inflight = None
        committed = bool(flags[1])
        if committed:
            committed = self._commit(s) if _rank() == 0 else False
            if dist.is_initialized():
                # Rank 0's outcome, and a point after which every rank sees the committed directory.
                result = torch.tensor([int(committed)], device=flags.device)
                dist.broadcast(result, src=0)
                committed = bool(result[0])
        elif _rank() == 0:
            warnings.warn(f"snapshot of step {s.step} was not committed: a rank failed to write it; the last "
                          "committed snapshot stays the latest", stacklevel=2)
        self._record(s, committed, by, waited)

    def _finish_alone(self) -> None:
        """After an exception no collective is safe. DCP's own result is the same on every rank and only
        succeeds after every rank's write returned, so rank 0 can commit on its own."""
        s, self._inflight = self._inflight, None
        if s is None:
            return
        waited = not s.future.done()
        committed = s.error() is None and _rank() == 0 and self._commit(s)
        self._record(s, committed, "exception", waited)

    def _commit(self, s: _InFlight) -> bool:
        final = s.partial.with_name(f"step-{s.step}")
        try:
            _write_durably(s.partial / MARKER, json.dumps({"step": s.step, "time": time.time()}))
            if final.exists():  # the same step from an abandoned earlier run: unmark it first, then replace
                (final / MARKER).unlink(missing_ok=True)
                shutil.rmtree(final)
            os.replace(s.partial, final)
            _fsync_dir(final.parent)
            _write_durably(final.parent / LATEST, final.name)
        except OSError as e:
            warnings.warn(f"snapshot of step {s.step} could not be committed: {e}", stacklevel=3)
            return False
        try:
            self._prune(s.step)
        except OSError as e:  # the commit stands; leftovers go at the next one
            warnings.warn(f"could not prune old snapshots in {self.dirpath}: {e}", stacklevel=3)
        return True

    def _prune(self, step: int) -> None:
        """Remove partial and unmarked leftovers, snapshots of steps after this one (an abandoned run's: the
        newest commit defines the run), and all but the ``keep`` newest."""
        root = self.dirpath
        for p in root.iterdir():
            if PARTIAL_NAME.match(p.name) or (STEP_NAME.match(p.name) and not is_committed(p)):
                shutil.rmtree(p, ignore_errors=True)
        steps = committed_steps(root)
        kept = sorted(s for s in steps if s <= step)[-self.keep:]
        for s, p in steps.items():
            if s not in kept:
                (p / MARKER).unlink(missing_ok=True)  # never leave a marked, half-deleted directory
                shutil.rmtree(p, ignore_errors=True)

    def _record(self, s: _InFlight, committed: bool, by: str, waited: bool) -> None:
        self.history.append({"step": s.step, "committed": committed, "by": by, "waited": waited,
                             "seconds": round(time.monotonic() - s.started, 4)})
        log.debug("snapshot of step %d %s (%s)", s.step, "committed" if committed else "dropped", by)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
