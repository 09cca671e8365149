"""One process of an elastic run: a member started with the job, or (DYNATRAIN_JOIN=1) a process joining it.

``--switches "step:layout[:leave ranks[:ahead]];..."``: the i-th entry is requested at the first micro-batch of an
optimizer step >= its step once the previous one has run (``ahead``: with ``plan_ahead=True``).
"""

import argparse
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

import dynatrain
from dynatrain import engine
from dynatrain.check.verify import SwitchVerificationError
from dynatrain.data import LlamaDataModule
from dynatrain.elastic.manager import JOIN_CHECKPOINT
from dynatrain.settings import JOIN_ENV
from dynatrain.launch.local import finish_rank
from dynatrain.lm.causal_lm import LlamaLM
from dynatrain.settings import THREADS_ENV

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a forked rank runs this file without its folder
from corruption import flip_received_byte  # noqa: E402

warnings.filterwarnings("ignore")


class Script(pl.Callback):
    """Requests the entries in order, each once the previous one has run. Its position is callback state: a
    joiner resumes it from the members' at the switch that admitted it, whichever switch that was."""

    def __init__(self, entries: list[tuple[int, str, tuple[int, ...], bool]], die: tuple[int, int] | None,
                 prepared_signal: tuple[str, str] | None = None, hold_for_joiner: int | None = None):
        self.entries = entries
        self.next = 0
        self.requested = None  # (the checked target, the ranks leaving) of the last request
        self.die = die  # (step, rank): that rank is killed at the boundary where a switch is pending
        # (layout, file): rank 0 creates the file once a world change to that layout is pending
        self.prepared_signal = prepared_signal
        # From this step's boundary on, a pending scale-out holds training until a joiner is ready: rank 0 waits
        # here, the others in the scale-out's broadcast. Else a joiner slow to start (a loaded machine) is admitted
        # only after the last step and trains none.
        self.hold_for_joiner = hold_for_joiner

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = state["next"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        pending = self.requested if strategy.switch_pending else None  # the request this script made last
        if (self.die and trainer.global_rank == self.die[1] and trainer.global_step >= self.die[0]
                and pending is not None and strategy.at_step_boundary()):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.prepared_signal and trainer.global_rank == 0 and pending is not None \
                and pending[0].short() == self.prepared_signal[0]:
            Path(self.prepared_signal[1]).touch()
        if (self.hold_for_joiner is not None and trainer.global_step >= self.hold_for_joiner
                and trainer.global_rank == 0 and pending is not None
                and pending[0].world_size > strategy.world_size - len(pending[1])
                and strategy.at_step_boundary()):
            deadline = time.monotonic() + 120
            while not strategy.elastic.ready_joiners() and time.monotonic() < deadline:
                time.sleep(0.05)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        strategy = trainer.strategy
        if self.next < len(self.entries) and not strategy.switch_pending:
            step, layout, leave, ahead = self.entries[self.next]
            if trainer.global_step >= step:
                self.requested = (strategy.request_switch(layout, leave=leave, plan_ahead=ahead), leave)
                self.next += 1


class Crash(pl.Callback):
    """SIGKILL one process (by the rank it started with) in the middle of an optimizer step: after its forward,
    before the backward whose collectives its peers then wait on."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step == self.step and int(os.environ.get("RANK", "-1")) == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


class Diverge(pl.Callback):
    """A test double of a survivor whose GPU ran work its peers never did (an optimizer update queued behind the
    collective that failed): in the step where a peer is killed, this process's copy of the first parameter's Adam
    moment changes, which its replica on another survivor does not see."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step == self.step and int(os.environ.get("RANK", "-1")) == self.rank:
            optimizer = trainer.optimizers[0]
            exp_avg = optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"]
            with torch.no_grad():
                exp_avg.to_local().view(-1)[0] += 1e-3


class Preempt(pl.Callback):
    """The cluster's notice: SIGTERM to one rank, once, at the start of an optimizer step."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank, self.sent = step, rank, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        started_as = int(os.environ.get("RANK", "-1"))  # ranks are renumbered after a world change
        if not self.sent and trainer.global_step >= self.step and started_as == self.rank:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def corrupted_transition(plan, rank, src, **kwargs):
    """The engine's transfer, then one byte of the first piece of a weight this process received flipped."""
    dst, stats = engine.run_transition(plan, rank, src, **kwargs)
    flip_received_byte(plan, rank, dst)
    return dst, stats


def main() -> None:
    if os.environ.get("DYNATRAIN_DEBUG_STACKS"):
        import faulthandler
        import threading

        def dump() -> None:
            while True:
                time.sleep(float(os.environ["DYNATRAIN_DEBUG_STACKS"]))
                faulthandler.dump_traceback(sys.stderr, all_threads=True)

        threading.Thread(target=dump, daemon=True).start()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", default="auto")
    ap.add_argument("--switches", default="")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--static", action="store_true", help="no elastic manager: the reference run")
    ap.add_argument("--die", default="", help="STEP:RANK killed at the boundary of a pending switch")
    ap.add_argument("--join-timeout", type=float, default=120.0)
    ap.add_argument("--preempt", default="", help="STEP:RANK gets SIGTERM (ElasticCallback with preemption on)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--crash", default="", help="STEP:RANK is SIGKILLed in the middle of that optimizer step")
    ap.add_argument("--diverge", default="", help="STEP:RANK changes its copy of a replicated state in that step")
    ap.add_argument("--prepared-signal", default=None, metavar="LAYOUT@FILE", help="rank 0 creates FILE once a "
                    "world change to LAYOUT is pending")
    ap.add_argument("--start-after", default=None, help="a joiner starts training only once this file exists")
    ap.add_argument("--hold-for-joiner", type=int, default=None, metavar="STEP",
                    help="from this step on, a pending scale-out holds training until a joiner is ready")
    ap.add_argument("--die-when-admitted", default=None, metavar="FILE", help="a joiner creates FILE and is "
                    "SIGKILLed as soon as the members admit it, before it forms their next world with them")
    ap.add_argument("--heartbeat", type=float, default=None, help="seconds between liveness beats")
    ap.add_argument("--corrupt-received", action="store_true",
                    help="one byte this process receives in a switch is flipped; the check's error is the result")
    ap.add_argument("--user-model", default=None, metavar="OPTIMIZER",
                    help="train tests/workers/user_model.py's UserLM with this optimizer instead of LlamaLM")
    args = ap.parse_args()
    entries = []
    for item in filter(None, args.switches.split(";")):
        parts = item.split(":")
        leave = tuple(int(r) for r in parts[2].split(",")) if len(parts) > 2 and parts[2] else ()
        entries.append((int(parts[0]), parts[1], leave, parts[3:] == ["ahead"]))
    if args.die_when_admitted:
        from dynatrain.elastic.manager import ElasticManager

        admitted = ElasticManager.await_admission

        def die_when_admitted(self, *a, **kw):
            out = admitted(self, *a, **kw)
            Path(args.die_when_admitted).touch()
            os.kill(os.getpid(), signal.SIGKILL)
            return out

        ElasticManager.await_admission = die_when_admitted
    joining = os.environ.get(JOIN_ENV) == "1"
    world = 1 if joining else int(os.environ.get("WORLD_SIZE", "1"))
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(
        parallel=args.layout, switching={"verify_switches": True, "switch_budget_mb": 0.5},
        elastic=None if args.static else {"timeout": args.timeout, "join_timeout": args.join_timeout,
                                          **({"heartbeat": args.heartbeat} if args.heartbeat else {})},
    )
    if args.corrupt_received:
        strategy.switch_transfer = corrupted_transition
    logger = CSVLogger(args.log_dir, name="run") if args.log_dir else False
    die = tuple(int(x) for x in args.die.split(":")) if args.die else None
    script = Script(entries, die, tuple(args.prepared_signal.split("@")) if args.prepared_signal else None,
                    args.hold_for_joiner)
    callbacks = [script]
    if args.crash:
        callbacks.append(Crash(*(int(x) for x in args.crash.split(":"))))
    if args.diverge:
        callbacks.append(Diverge(*(int(x) for x in args.diverge.split(":"))))
    if args.preempt:
        from dynatrain.callbacks import ElasticCallback

        callbacks.append(ElasticCallback(preemption={"grace_seconds": 60}, max_devices=4))
        callbacks.append(Preempt(*(int(x) for x in args.preempt.split(":"))))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=args.steps, logger=logger,
        default_root_dir=os.path.dirname(os.path.abspath(args.out)),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=callbacks,
    )
    if args.user_model:
        sys.path.insert(0, str(Path(__file__).parent))
        from user_model import UserLM

        module = UserLM(args.user_model)
    else:
        module = LlamaLM(model="debug", model_overrides={"n_layers": 2}, lr=1e-3, warmup_steps=2)
    data = LlamaDataModule(seq_len=64, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
                           max_corpus_bytes=400_000)
    while args.start_after and not os.path.exists(args.start_after):
        time.sleep(0.05)
    check_error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, datamodule=data, ckpt_path=JOIN_CHECKPOINT if joining else None)
        except SwitchVerificationError as e:
            check_error = str(e)
    result = {
        "check_error": check_error,
        "losses": module.step_losses,
        "left": strategy.detached,
        "layout": strategy.parallel_config.short(),
        "world_size": trainer.world_size,
        "global_rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "reports": [r.as_dict() for r in strategy.switch_reports],
        "recoveries": [r.as_dict() for r in strategy.recovery_reports],
        "member": strategy.elastic.member_id if strategy.elastic else None,
        "threads": torch.get_num_threads(),
        "threads_env": os.environ.get(THREADS_ENV),
        "processes_on_host": strategy.elastic.processes_on_this_host()
        if strategy.elastic and not strategy.detached else None,
        "thread_splits": strategy.elastic.thread_splits if strategy.elastic else None,
        "log_dir": trainer.log_dir if logger else None,
        "warnings": [str(w.message) for w in caught],
    }
    if args.user_model and not strategy.detached:
        result["logit_scale"] = module.net.logit_scale.item()
    del trainer, module
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
