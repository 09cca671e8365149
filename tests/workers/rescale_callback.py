"""One rank of a short run under ElasticCallback; rank 0 can send control commands and write the watched file.

``--actions "step:what;..."`` run at the boundary closing that step, before the callback agrees on requests, so
each lands at a known step. On rank 0: ``control-wrong:LAYOUT`` (wrong token), ``control:LAYOUT``,
``control-devices:N``, ``file-bad`` (malformed JSON), ``file:LAYOUT``. On rank R: ``preempt:R`` (SIGTERM to itself).
"""

import argparse
import contextlib
import io
import json
import os
import signal
import time
import warnings

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

import dynatrain
from dynatrain.callbacks.rescale import ElasticCallback
from dynatrain.cli import scale
from dynatrain.data import LlamaDataModule
from dynatrain.launch.local import finish_rank
from dynatrain.runtime.loggers import WandbLogger
from dynatrain.lm.causal_lm import LlamaLM

warnings.filterwarnings("ignore")


def _wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.02)


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Script(pl.Callback):
    def __init__(self, elastic: ElasticCallback, actions: list[tuple[int, str]], token_file: str | None,
                 watch: str | None) -> None:
        self.elastic, self.actions, self.token_file, self.watch = elastic, actions, token_file, watch
        self.control: list[dict] = []
        self.bar_layout = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.strategy.at_step_boundary():
            return
        due = [a for a in self.actions if a[0] == trainer.global_step]
        for action in due:
            self.actions.remove(action)
            self._run(action[1], trainer.global_rank)

    def _run(self, action: str, rank: int) -> None:
        kind, _, arg = action.partition(":")
        hub = self.elastic.hub
        if kind == "preempt":
            if int(arg) == rank:
                os.kill(os.getpid(), signal.SIGTERM)
                _wait_for(lambda: hub.peek() is not None, "the preemption queued")
            return
        if rank != 0:
            return
        if kind.startswith("control"):
            token = open(self.token_file).read().strip()
            target = ["--devices", arg] if kind == "control-devices" else ["--layout", arg]
            self._scale(["--token", "wrong-" + token if kind == "control-wrong" else token, *target])
        elif kind == "file-bad":
            seen = len(hub.rejected)
            _write_atomically(self.watch, '{"layout": "tp=2"')
            _wait_for(lambda: len(hub.rejected) > seen, "the malformed file rejected")
        elif kind == "file":
            _write_atomically(self.watch, json.dumps({"layout": arg}))
            _wait_for(lambda: hub.peek() is not None, "the watched file's request queued")
        else:
            raise ValueError(f"unknown action {action!r}")

    def _scale(self, argv: list[str]) -> None:
        # The command line a user types: `dynatrain scale --endpoint ... --token ... --layout ...`.
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = scale.main(["--endpoint", self.elastic.control_endpoint, *argv])
        self.control.append({"argv": argv[2:], "exit": code, "output": out.getvalue()})

    def on_train_end(self, trainer, pl_module):
        bar = trainer.progress_bar_callback
        if bar is not None:
            self.bar_layout = bar.get_metrics(trainer, pl_module).get("layout")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--layout", default="dp_shard=2")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--trace", default="[]", help="JSON list of [step, devices or layout]")
    ap.add_argument("--max-devices", type=int, default=None)
    ap.add_argument("--actions", default="")
    ap.add_argument("--control", action="store_true")
    ap.add_argument("--watch", action="store_true")
    ap.add_argument("--preemption", action="store_true")
    ap.add_argument("--wandb", action="store_true")
    ap.add_argument("--progress-bar", action="store_true")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = args.run_dir
    token_file = os.path.join(run_dir, "token") if args.control else None
    watch = os.path.join(run_dir, "scale.json") if args.watch else None
    actions = [(int(a.split(":")[0]), a.split(":", 1)[1]) for a in args.actions.split(";") if a]
    elastic = ElasticCallback(
        trace=json.loads(args.trace), max_devices=args.max_devices, switch_fixed_seconds=0.0,
        control={"token_file": token_file} if args.control else False,
        watch_file={"path": watch, "poll_seconds": 0.05} if watch else None,
        preemption={"grace_seconds": 60} if args.preemption else False,
    )
    script = Script(elastic, actions, token_file, watch)
    loggers = [CSVLogger(save_dir=run_dir, name="csv")]
    if args.wandb:
        loggers.append(WandbLogger(save_dir=run_dir, name="elastic-test"))

    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel=args.layout,
                                           switching={"verify_switches": True, "switch_budget_mb": 1})
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=args.steps, logger=loggers,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=args.progress_bar,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[script, elastic],
    )
    module = LlamaLM(model="debug", model_overrides={"n_layers": 2}, lr=1e-3, warmup_steps=2)
    data = LlamaDataModule(seq_len=64, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
                           max_corpus_bytes=200_000)
    trainer.fit(module, datamodule=data)
    result = {
        "losses": module.step_losses,
        "layout": strategy.parallel_config.short(),
        "global_step": trainer.global_step,
        "reports": [r.as_dict() for r in strategy.switch_reports],
        "decisions": [d.as_dict() for d in elastic.decisions],
        "hub_rejected": [{"source": r.source, "reason": r.reason} for r in elastic.hub.rejected],
        "control": script.control,
        "bar_layout": script.bar_layout,
        "log_dir": str(elastic.switch_log.run_dir),
        "control_endpoint": elastic.control_endpoint,
    }
    del trainer, module, strategy
    finish_rank(args.out, result)


if __name__ == "__main__":
    main()
