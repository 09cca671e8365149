"""One process of `bench/restart.py`: a launch of the checkpoint-and-restart chain, or a process of the elastic job.

``--mode lightning``: Lightning's own `ModelParallelStrategy` on ``--layout``; resumes from ``--resume`` (a DCP
checkpoint directory) when given, trains to step ``--stop-at``, saves a DCP checkpoint to ``--save`` there and
exits, the way a user restarts a job on another device count today.

``--mode dynatrain``: an elastic member (or, with ``DYNATRAIN_JOIN=1``, a joiner) that runs ``--actions`` in
order, each ``--gap`` optimizer steps after the previous switch; ``world:T`` and ``layout:T`` go through
``strategy.request_switch(T)`` (a larger world waits for ready joiners), ``identity:T`` runs
``strategy.switch(T, rank_map="identity")`` at once.

Every process writes wall-clock marks (``time.time()``, one machine clock for every process) of its start, its
Lightning milestones and the end of every optimizer step, so the parent measures a stall as the end of the last
step before a change to the end of the first step after it.
"""

import time

T_START = time.time()  # before the heavy imports: process start-up is part of a restart's stall

import argparse  # noqa: E402
import os  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

import dynatrain  # noqa: E402
from _trainer import bench_data, bench_trainer  # noqa: E402  (this folder)
import dynatrain.elastic.world as world_mod  # noqa: E402
from dynatrain.elastic.manager import JOIN_CHECKPOINT  # noqa: E402
from dynatrain.engine import run_transition  # noqa: E402
from dynatrain.settings import JOIN_ENV  # noqa: E402
from dynatrain.launch.local import finish_rank  # noqa: E402
from dynatrain.lm.causal_lm import LlamaLM  # noqa: E402
from dynatrain.vps.parallel_config import ParallelConfig  # noqa: E402

T_IMPORTED = time.time()
warnings.filterwarnings("ignore")

# ---------------------------------------------------------------------------------------------- phase capture
# The SwitchReport's `transfer` phase of a world change covers forming the union generation, the engine's
# transfer and forming the target generation; wrapping the three calls (the engine's as the strategy's
# ``switch_transfer``) splits it without touching dynatrain.
EVENTS: list[dict] = []
_orig_join = world_mod.WorldGeneration.join.__func__
_orig_leave = world_mod.WorldGeneration.leave


def _timed_join(cls, store, generation, member_id, members, *args, **kwargs):
    t0 = time.time()
    world = _orig_join(cls, store, generation, member_id, members, *args, **kwargs)
    EVENTS.append({"kind": "form_generation", "generation": generation, "members": len(tuple(members)),
                   "start": t0, "end": time.time()})
    return world


def _timed_leave(self, *args, **kwargs):
    t0 = time.time()
    _orig_leave(self, *args, **kwargs)
    EVENTS.append({"kind": "leave_generation", "generation": self.generation, "start": t0, "end": time.time()})


def _timed_run_transition(plan, rank, src, **kwargs):
    t0 = time.time()
    dst, stats = run_transition(plan, rank, src, **kwargs)
    EVENTS.append({"kind": "engine", "start": t0, "end": time.time(), "stats": stats.as_dict()})
    return dst, stats


world_mod.WorldGeneration.join = classmethod(_timed_join)
world_mod.WorldGeneration.leave = _timed_leave


# ---------------------------------------------------------------------------------------------- clocks
class Clock(pl.Callback):
    """Wall-clock marks of Lightning's milestones and of the end of every optimizer step, and per step the time
    spent in forward, backward and from backward to the end of the batch (optimizer step and its syncs), and the
    process's CPU time from the step's first micro-batch to its end and the machine's load average at its end."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {"start": T_START, "imported": T_IMPORTED}
        self.step_ends: list[tuple[int, float]] = []
        self.step_parts: dict[int, dict[str, float]] = {}
        self._parts = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self._t = 0.0
        self._cpu: float | None = None  # CPU time at the first micro-batch of the step under way
        self._seen: int | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        self.marks.setdefault("setup", time.time())  # process group formed, data prepared

    def on_fit_start(self, trainer, pl_module) -> None:
        self.marks["fit_start"] = time.time()  # model built and sharded, optimizer made, checkpoint restored

    def on_train_start(self, trainer, pl_module) -> None:
        self.marks["train_start"] = time.time()
        self._seen = trainer.global_step

    def _lap(self, part: str) -> None:
        now = time.time()
        self._parts[part] += now - self._t
        self._t = now

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t = time.time()
        self.marks.setdefault("first_batch", self._t)
        if self._cpu is None:
            self._cpu = time.process_time()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._lap("forward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._lap("backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._lap("optimizer")
        if trainer.global_step != self._seen:
            self._seen = trainer.global_step
            self.step_ends.append((trainer.global_step, time.time()))
            # CPU seconds of this process over the step: far below the wall time, it waited for the cores or peers
            self.step_parts[trainer.global_step] = {**self._parts, "cpu": time.process_time() - self._cpu,
                                                    "load": os.getloadavg()[0]}
            self._parts = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
            self._cpu = None


class SaveAndStop(pl.Callback):
    """At step ``stop_at``: a DCP checkpoint of the whole training state (what ModelCheckpoint writes), then stop."""

    def __init__(self, stop_at: int, path: str | None) -> None:
        self.stop_at, self.path = stop_at, path
        self.seconds: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.stop_at or self.seconds is not None:
            return
        if self.path:
            t0 = time.time()
            trainer.save_checkpoint(self.path)
            self.seconds = time.time() - t0
        trainer.should_stop = True


class TimedModelParallel(ModelParallelStrategy):
    """Lightning's strategy unchanged, with the DCP read of the resume timed."""

    load_marks: tuple[float, float] | None = None

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        t0 = time.time()
        out = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.load_marks = (t0, time.time())
        return out


class Actions(pl.Callback):
    """Runs the elastic script: one action per switch, ``gap`` steps after the previous one, the same on every
    process (a joiner starts at action ``first``, counting from the step it joined at)."""

    def __init__(self, actions: list[tuple[str, str]], first: int, gap: int, start_at: int,
                 signal_file: str | None) -> None:
        self.actions, self.next, self.gap, self.start_at = actions, first, gap, start_at
        self.done_before = first
        self.signal_file = signal_file
        self.last_step: int | None = None
        self.requests: list[dict] = []
        self.stop_at: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        if not strategy.at_step_boundary():
            return
        step = trainer.global_step
        self._signal(strategy, step)
        if strategy.switch_pending:
            return  # a scale-out waiting for its joiners
        done = len(strategy.switch_reports) + self.done_before
        if strategy.switch_reports:
            self.last_step = strategy.switch_reports[-1].step
        if self.next >= len(self.actions):
            if step >= self.last_step + self.gap:
                trainer.should_stop = True
            return
        if done != self.next or step < max(self.last_step + self.gap, self.start_at):
            return
        kind, target = self.actions[self.next]
        self.next += 1
        self.requests.append({"step": step, "kind": kind, "target": target, "time": time.time()})
        if kind == "identity":
            strategy.switch(target, rank_map="identity")
        else:
            strategy.request_switch(target)  # the boundary hook, after this callback, runs it (or waits)

    def _signal(self, strategy, step: int) -> None:
        """Tell the parent that the first switch is done and trained on: it starts the joiners now, so their
        start-up overlaps training."""
        if (self.signal_file and strategy.global_rank == 0 and strategy.switch_reports
                and step > strategy.switch_reports[0].step and not Path(self.signal_file).exists()):
            Path(self.signal_file).write_text(str(time.time()))


# ---------------------------------------------------------------------------------------------- the script
def run_lightning(args) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    pcfg = ParallelConfig.parse(args.layout)
    strategy = TimedModelParallel(data_parallel_size=pcfg.dp_size, tensor_parallel_size=pcfg.tp)
    clock, saver = Clock(), SaveAndStop(args.stop_at, args.save)
    trainer = bench_trainer(strategy, world, args.stop_at, [clock, saver])
    module = LlamaLM(model=args.model, lr=1e-3, warmup_steps=2, total_steps=100)
    clock.marks["fit_call"] = time.time()
    trainer.fit(module, datamodule=bench_data(args), ckpt_path=args.resume)
    result = {"rank": trainer.global_rank, "marks": clock.marks, "step_ends": clock.step_ends,
              "step_parts": clock.step_parts, "save_s": saver.seconds, "load": strategy.load_marks,
              "losses": module.step_losses, "fit_end": time.time()}
    del trainer, module, strategy
    return result


def run_dynatrain(args) -> dict:
    joining = os.environ.get(JOIN_ENV) == "1"
    world = 1 if joining else int(os.environ["WORLD_SIZE"])
    strategy = dynatrain.DynaTrainStrategy(parallel=args.layout, switching={"verify_switches": False},
                                           elastic={"timeout": 300.0, "join_timeout": 900.0})
    strategy.switch_transfer = _timed_run_transition
    actions = [tuple(a.split(":", 1)) for a in args.actions.split(";") if a]
    clock = Clock()
    script = Actions(actions, args.first if joining else 0, args.gap, args.start_at,
                     None if joining else args.signal_file)
    trainer = bench_trainer(strategy, world, args.max_steps, [clock, script])
    module = LlamaLM(model=args.model, lr=1e-3, warmup_steps=2, total_steps=100)
    clock.marks["fit_call"] = time.time()
    trainer.fit(module, datamodule=bench_data(args), ckpt_path=JOIN_CHECKPOINT if joining else None)
    manager = strategy.elastic
    ready = None
    if joining:
        ready = float(manager.store.get(f"elastic/ready/{manager.member_id}").decode())
    result = {"rank": trainer.global_rank, "member": manager.member_id, "joiner": joining, "left": strategy.detached,
              "marks": clock.marks, "ready": ready, "step_ends": clock.step_ends, "step_parts": clock.step_parts,
              "requests": script.requests,
              "reports": [r.as_dict() for r in strategy.switch_reports], "events": EVENTS,
              "losses": module.step_losses, "fit_end": time.time()}
    del trainer, module, strategy
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("lightning", "dynatrain"), required=True)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--layout", default="dp_shard=4")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--stop-at", type=int, default=3, help="lightning: last step of this launch")
    ap.add_argument("--resume", default=None, help="lightning: DCP checkpoint directory to resume from")
    ap.add_argument("--save", default=None, help="lightning: DCP checkpoint directory written at --stop-at")
    ap.add_argument("--actions", default="", help="dynatrain: 'kind:target;...' (kind world, layout, identity)")
    ap.add_argument("--first", type=int, default=0, help="dynatrain: the action a joiner joins with")
    ap.add_argument("--gap", type=int, default=2, help="dynatrain: steps from one switch to the next action")
    ap.add_argument("--start-at", type=int, default=3, help="dynatrain: no action before this step")
    ap.add_argument("--max-steps", type=int, default=400, help="dynatrain: a bound; the script stops the job")
    ap.add_argument("--signal-file", default=None, help="dynatrain: written once the first switch trained on")
    args = ap.parse_args()
    pl.seed_everything(1234, verbose=False)
    result = run_lightning(args) if args.mode == "lightning" else run_dynatrain(args)
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
