"""One process of `dynatrain selfcheck`: train, switch at the given steps, compare each switch with the oracle.

A process is a rank the job started with or, in an elastic run (``--elastic``, ``DYNATRAIN_JOIN=1``), a process
that joins it at a scale-out. Switch ``i`` (``layouts[i] -> layouts[i+1]``) runs at the end of optimizer step
``(i+1) * steps_between``. Around it, every process checks the oracle collectively: the old world saves the state
with DCP just before the switch, the new world loads it into a fresh model of the target layout and compares.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import signal
from contextlib import nullcontext
import warnings
from pathlib import Path

import importlib

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning.pytorch.utilities.model_helpers import is_overridden

import dynatrain
from dynatrain.runtime import control_group
from dynatrain.data import LlamaDataModule
from dynatrain.elastic.manager import JOIN_CHECKPOINT
from dynatrain.settings import JOIN_ENV, explicit_or_env
from dynatrain.launch.local import finish_rank
from dynatrain.lm.causal_lm import CausalLM
from dynatrain.models.pipeline_split import pipeline_stages
from dynatrain.strategies.options import DataOptions, ParallelismOptions, SwitchingOptions
from dynatrain.strategies.pipeline_runner import PipelineRunner, stack_batches
from dynatrain.selfcheck import faults, oracle
from dynatrain.vps.parallel_config import ParallelConfig


class ScriptedSwitches(pl.Callback):
    def __init__(self, layouts: list[str], steps_between: int, workdir: Path, check: bool, death: int | None = None):
        self.layouts = [ParallelConfig.parse(s) for s in layouts]
        # Transition ``death`` is no request: its layout's last rank is killed in the middle of the next step, and
        # the survivors' rebuilt state is compared with the one saved at the boundary before it.
        self.death = death
        self._dying: tuple[int, int] | None = None  # (transition, world it starts from) while the death is due
        self._recoveries = 0
        self.steps_between = steps_between
        self.workdir = workdir
        self.check = check
        self.next = 0  # index of the next switch this process takes part in
        self.first_step = 0  # the optimizer step this process started training at (a joiner's is its switch's)
        self.results: list[dict] = []
        # The oracle's model and optimizer and the micro-batches left to train them on for one step, or None.
        self.shadow = None
        self._shadow_batches: list = []  # under pp, the step's micro-batches so far

    # ---- the switches -----------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self.first_step = trainer.global_step
        strategy = trainer.strategy
        if strategy.elastic is None or not strategy.elastic.joining:
            return
        # A joiner enters here, right after the switch that admitted it. The members compare that switch with the
        # oracle as soon as it returns (in on_train_batch_end below) and the joiner has run no collective since
        # the switch's own, so on both sides the next collectives are the oracle's load and comparison.
        index = trainer.global_step // self.steps_between - 1
        self.next = index + 1
        record = self._record(index, world_from=None, report=None)
        self.results.append(record)
        self._compare(trainer, pl_module, record)

    def setup(self, trainer, pl_module, stage: str) -> None:
        # The oracle's checkpoint is the state the switch moves (saved as it starts, after the step's hooks), and
        # the comparison runs as soon as it ends.
        self._armed: tuple[int, int] | None = None  # (switch index, world it starts from)
        trainer.strategy.switch_guards.append(lambda: self._save(trainer, pl_module))
        trainer.strategy.after_switch.append(lambda report: self._switched(trainer, pl_module, report))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.shadow is not None:
            self._shadow_micro_batch(trainer, pl_module, batch)
        strategy = trainer.strategy
        if self._armed is not None and not strategy.switch_pending:  # refused, or a scale-out that timed out
            self.results.append(self._record(self._armed[0], self._armed[1], None))
            self._armed = None
        index = self.next
        if index >= len(self.layouts) - 1 or trainer.global_step != (index + 1) * self.steps_between:
            return
        if not strategy.at_step_boundary():
            return
        self.next += 1
        if index == self.death:
            self._dying = (index, strategy.world_size)
            if self.check:
                oracle.save(pl_module, strategy.optimizers[0], self._checkpoint(index))
            return
        self._armed = (index, strategy.world_size)
        # At this boundary, after the module's own hooks, as any switch; a scale-out holds training until its
        # joiners are ready, so that the switch is the one of this step.
        strategy.request_switch(self.layouts[index + 1], wait=True)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._dying is None or trainer.global_rank != trainer.world_size - 1:
            return
        # Mid-step, before a backward whose collectives the others then wait on; the mark says which process died.
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / f"victim-{os.getpid()}").touch()
        os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        reports = trainer.strategy.recovery_reports
        if len(reports) == self._recoveries:
            return
        self._recoveries = len(reports)
        if self._dying is None:
            return
        (index, world_from), self._dying = self._dying, None
        report = reports[-1]
        record = self._record(index, None, None)
        record.update({"from": report.old_layout, "to": report.new_layout, "world_from": world_from,
                       "world_to": report.survivors, "death": True, "seconds": report.seconds,
                       "bytes_moved": report.bytes_moved})
        self.results.append(record)
        self._compare(trainer, pl_module, record)  # the rebuilt state against the one saved before the death

    def _save(self, trainer, pl_module) -> None:
        if self._armed is not None and self.check:
            oracle.save(pl_module, trainer.strategy.optimizers[0], self._checkpoint(self._armed[0]))

    def _switched(self, trainer, pl_module, report) -> None:
        if self._armed is None:
            return
        (index, world_from), self._armed = self._armed, None
        record = self._record(index, world_from, report)
        self.results.append(record)
        if not trainer.strategy.detached:
            self._compare(trainer, pl_module, record)

    def _checkpoint(self, index: int) -> Path:
        return self.workdir / f"before-switch-{index}"

    def _record(self, index: int, world_from: int | None, report) -> dict:
        old, new = self.layouts[index], self.layouts[index + 1]
        record = {
            "index": index, "from": old.short(), "to": new.short(), "world_from": old.world_size,
            "world_to": new.world_size, "step": (index + 1) * self.steps_between, "bitwise_equal": None,
            "step_after_equal": None, "left": False, "dropped": report is None and world_from is not None,
        }
        if report is not None:
            record.update({
                "from": report.old_layout, "to": report.new_layout, "world_from": world_from,
                "left": report.world_size == 0, "bytes_moved": report.bytes_moved,
                "bytes_moved_identity": report.bytes_moved_identity, "bytes_total": report.bytes_total,
                "seconds": report.stall_s, "phases": report.phases, "peak_bytes": report.peak_bytes,
                "peak_bound": report.peak_bound,
            })
        return record

    # ---- the oracle -------------------------------------------------------------------------------------------
    def _compare(self, trainer, pl_module, record: dict) -> None:
        """Every process of the new world: load the pre-switch checkpoint into the target layout, compare."""
        if not self.check:
            return
        strategy = trainer.strategy
        model, optimizer = oracle.load_into_layout(strategy, pl_module, self._checkpoint(record["index"]))
        record["bitwise_equal"] = oracle.bitwise_equal(pl_module, strategy.optimizers[0], model, optimizer,
                                                       strategy.root_device)
        if trainer.global_step < trainer.max_steps:
            # The micro-batch count is read at the first micro-batch: a joiner's accumulation is set after this.
            self.shadow = (model, optimizer, None)

    def _shadow_micro_batch(self, trainer, pl_module, batch) -> None:
        """Train the oracle's copy on the same micro-batches; after one step its state must still be equal."""
        model, optimizer, left = self.shadow
        if left is None:
            left = trainer.accumulate_grad_batches
        strategy = trainer.strategy
        if strategy.pipeline is not None:
            # Under pp the oracle's copy runs its own schedule over the step's micro-batches, as the strategy does.
            self._shadow_batches.append(batch)
        else:
            loss = model.training_step(batch, 0)  # the oracle is a copy of the LightningModule: its own loss
            if isinstance(loss, dict):
                loss = loss["loss"]
            with getattr(model, "loss_context", nullcontext)():  # a vocabulary-parallel loss runs backward in it
                (loss / trainer.accumulate_grad_batches).backward()
        left -= 1
        self.shadow = (model, optimizer, left)
        if left:
            return
        if strategy.pipeline is not None:
            runner = PipelineRunner(pipeline_stages(model), strategy.device_mesh,
                                    strategy.parallelism.pipeline_schedule, model.pipeline_loss, strategy.root_device,
                                    getattr(model, "loss_context", nullcontext))
            inputs, target = stack_batches(self._shadow_batches)
            runner.train_step(inputs, target, len(self._shadow_batches))
            self._shadow_batches = []
        optimizer.step()
        self.results[-1]["step_after_equal"] = oracle.bitwise_equal(
            pl_module, trainer.strategy.optimizers[0], model, optimizer, trainer.strategy.root_device,
            buffers=False)  # the module's own hooks, which the oracle does not run, may change buffers
        self.shadow = None
        gc.collect()


class StepLosses(pl.Callback):
    """The loss of each optimizer step over the whole global batch, for modules that do not record it: the mean of
    every micro-batch's loss on every rank (micro-batches are equal-sized)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self._micro: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._micro.append(loss.detach().float() * trainer.accumulate_grad_batches)  # Lightning divided it
        if trainer.strategy.at_step_boundary() and not trainer.strategy.detached:
            mean = torch.stack(self._micro).mean()
            if dist.is_initialized():
                dist.all_reduce(mean)
                mean /= dist.get_world_size()
            self.losses.append(mean.item())
            self._micro.clear()

    def on_train_step_discarded(self) -> None:
        self._micro.clear()  # a process was lost mid-step: the step runs again on the survivors


class StepSamples(pl.Callback):
    """The global sample indices of each optimizer step: what every data-parallel rank's sampler handed out (the
    ranks of one tp or pp group read one batch: the strategy's guard compares them), merged."""

    def __init__(self) -> None:
        self.samples: list[list[int]] = []
        self._seen: list = []

    def on_train_step_discarded(self) -> None:
        # A process was lost mid-step: the step runs again on the survivors, who read its samples afresh.
        for sampler in self._seen:
            sampler.trace.clear()

    @staticmethod
    def _samplers(trainer) -> list:
        own = [s for _, s in trainer.strategy.data_split.train]
        zoo = getattr(getattr(trainer, "datamodule", None), "train_sampler", None)
        return own + ([zoo] if zoo is not None and hasattr(zoo, "trace") else [])

    def on_train_start(self, trainer, pl_module) -> None:
        self._seen = self._samplers(trainer)
        for sampler in self._seen:
            sampler.trace = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        if not self._seen or not strategy.at_step_boundary() or strategy.detached:
            return
        mine = [i for s in self._seen for i in s.trace]
        for s in self._seen:
            s.trace.clear()
        per_rank = dict(control_group.all_gather_object((strategy.dp_rank, mine), strategy.control_group))
        self.samples.append(sorted(i for indices in per_rank.values() for i in indices))


def load_class(path: str):
    """``pkg.module:Class`` -> the class (its module importable from the working directory or PYTHONPATH)."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise SystemExit(f"{path!r}: write a class as pkg.module:ClassName")
    return getattr(importlib.import_module(module), name)


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--layouts", required=True, help="layouts separated by '>'")
    ap.add_argument("--steps-between", type=int, default=2)
    ap.add_argument("--static", action="store_true", help="train the same steps on the first layout only")
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--budget-mb", type=float, default=64.0)
    ap.add_argument("--rank-map", default="auto")
    ap.add_argument("--n-layers", type=int, default=None)
    ap.add_argument("--pipeline-schedule", default="1F1B")
    ap.add_argument("--stages-per-rank", type=int, default=1)
    ap.add_argument("--workdir", required=True, help="a folder every rank sees: the oracle's DCP checkpoints")
    ap.add_argument("--elastic", action="store_true", help="the layouts change the world: processes leave and join")
    ap.add_argument("--elastic-timeout", type=float, default=120.0,
                    help="seconds to form a world and for its collectives")
    ap.add_argument("--join-timeout", type=float, default=900.0, help="seconds a joiner waits for its scale-out")
    ap.add_argument("--inject", default=None, help="a fault scenario of dynatrain.selfcheck.faults")
    ap.add_argument("--death", type=int, default=None,
                    help="transition INDEX of --layouts is a process dying (a chaos run), not a request")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: one stretch per layout)")
    ap.add_argument("--restarted", action="store_true", help="start from the fault scenario's latest snapshot")
    ap.add_argument("--module", default=None,
                    help="pkg.module:Class, a LightningModule to check instead of the zoo's CausalLM")
    ap.add_argument("--datamodule", default=None, help="pkg.module:Class (default: the embedded corpus, bytes)")
    return ap.parse_args()


def main() -> None:
    warnings.filterwarnings("ignore")
    args = _arguments()
    layouts = [s.strip() for s in args.layouts.split(">")]
    steps = args.steps or args.steps_between * len(layouts)
    joining = explicit_or_env(None, JOIN_ENV) == "1"
    # A joiner is one process that enters a running world; its rank comes with the switch that admits it.
    world = 1 if joining else int(os.environ.get("WORLD_SIZE", "1"))
    pl.seed_everything(1234, verbose=False)
    workdir = Path(args.workdir) / ("static" if args.static else "switching")
    elastic = ({"timeout": args.elastic_timeout, "join_timeout": args.join_timeout}
               if args.elastic and not args.static else False)
    strategy = dynatrain.DynaTrainStrategy(
        parallel=layouts[0], elastic=elastic, data=DataOptions(check_batches=True),
        parallelism=ParallelismOptions(pipeline_schedule=args.pipeline_schedule, stages_per_rank=args.stages_per_rank),
        switching=SwitchingOptions(switch_budget_mb=args.budget_mb, rank_map=args.rank_map, verify_switches=False))
    extra = []
    if args.inject:
        script = faults.InjectFault(args.inject, workdir, restarted=args.restarted)
        extra = script.callbacks()
        if joining:
            faults.die_before_ready()
    else:
        script = ScriptedSwitches([layouts[0]] if args.static else layouts, args.steps_between, workdir, check=True,
                                  death=None if args.static else args.death)
    if args.module:
        module = load_class(args.module)()
    else:
        overrides = {"n_layers": args.n_layers} if args.n_layers else None
        module = CausalLM(model=args.model, model_overrides=overrides, lr=1e-3, warmup_steps=2)
    # A module with its own train_dataloader() trains on it, split by the strategy as Lightning's sampler leaves it.
    own_data = args.module is not None and not args.datamodule and is_overridden("train_dataloader", module)
    # Its global batch is its loader's batch size x the first data-parallel size x this accumulation: a multiple of
    # every layout's data-parallel size, so that each keeps it.
    sizes = [ParallelConfig.parse(layout).dp_size for layout in layouts]
    if args.inject:
        # A fault scenario's worlds (4, then 3 survivors; 2, then 1 restarted) come from no --layouts: keep the
        # global batch of 12 micro-batches its zoo data has, which every one of them divides.
        sizes.append(faults.GLOBAL_MICRO_BATCHES)
    accumulation = math.lcm(*sizes) // sizes[0] if own_data else 1
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, logger=False,
                         accumulate_grad_batches=accumulation,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=own_data,
                         callbacks=[recorder := StepLosses(), samples := StepSamples(), script, *extra])
    if own_data:
        data = None
    elif args.datamodule:
        data = load_class(args.datamodule)()
    else:
        data = LlamaDataModule(seq_len=args.seq_len, global_batch_size=args.global_batch,
                               micro_batch_size=args.micro_batch, max_corpus_bytes=1_000_000)
    resume = JOIN_CHECKPOINT if joining else (str(script.snapshots) if args.restarted else None)
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    if args.inject:
        result = script.result(trainer)
    else:
        result = {"losses": getattr(module, "step_losses", recorder.losses), "first_step": script.first_step,
                  "switches": script.results, "left": strategy.detached, "joined": joining,
                  "samples": samples.samples}
    del trainer, module, strategy
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
