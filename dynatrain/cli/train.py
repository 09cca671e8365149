"""`dynatrain fit`: LightningCLI over `CausalLM` (the zoo's dense and MoE models) and `LlamaDataModule`, with
dynatrain's trainer defaults."""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from dynatrain.launch.local import teardown_distributed


def _summarise_switches(trainer) -> None:
    """The switch table, and the loss curve with the switches marked, written next to the switch log."""
    from lightning.pytorch.loggers import CSVLogger

    from dynatrain.callbacks.switch_log import SwitchLog, format_switch_table, plot_loss_with_switches

    log = next((cb for cb in trainer.callbacks if isinstance(cb, SwitchLog)), None)
    if log is None or not log.records or log.jsonl_path is None:
        return
    rank_zero_info("switches:\n" + format_switch_table(log.records))
    csv = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
    if csv is not None:
        csv.finalize("success")
        png = log.run_dir / "loss_switches.png"
        plot_loss_with_switches(os.path.join(csv.log_dir, "metrics.csv"), log.jsonl_path, png)
        rank_zero_info(f"loss curve with switches: {os.path.abspath(png)}")


def _where(logger) -> str:
    """One line saying where a logger wrote the run (for W&B offline, also how to upload it)."""
    from lightning.pytorch.loggers import WandbLogger

    if isinstance(logger, WandbLogger):
        run_dir = getattr(getattr(logger, "_experiment", None), "dir", None)
        if run_dir:
            run = os.path.dirname(os.path.abspath(run_dir))  # the run's folder; `dir` is its files/ folder
            return f"W&B run: {run} (upload with: wandb sync {run})"
    where = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
    return f"{type(logger).__name__} logs: {os.path.abspath(where)}" if where else ""


def check_layout(trainer, model, datamodule) -> None:
    """Refuse a layout that cannot run before any process starts, with the error each rank would raise later.

    Checks a `DynaTrainStrategy`'s layout (pinned, or "auto" = pure FSDP) against the devices
    (``num_nodes * devices``), the model (``tp`` must divide heads, KV heads, FFN width, vocabulary) and the
    data module's global batch. A process joining an elastic job takes the layout of the switch it joins, so it
    is not checked.
    """
    from dynatrain.elastic.rendezvous import launched_by_rendezvous
    from dynatrain.models.registry import zoo_config_of

    strategy = trainer.strategy
    if not hasattr(strategy, "parallel_request") or _elastic(strategy, "join"):
        return
    if launched_by_rendezvous():
        # torchrun's variables say the world this process starts in; the Trainer's num_nodes cannot while nodes
        # come and go.
        devices, per_node = trainer.world_size, trainer.num_devices
        nodes = max(1, devices // per_node)
    else:
        nodes, per_node = trainer.num_nodes, trainer.num_devices
        devices = nodes * per_node
    pcfg = strategy.requested_layout(nodes, per_node)
    pcfg.validate(zoo_config_of(model), devices)
    if hasattr(datamodule, "accumulation_for"):
        try:
            datamodule.accumulation_for(pcfg.dp_size)
        except ValueError as e:
            raise ValueError(f"layout {pcfg.short()} on {devices} devices: {e}") from None


def _elastic(strategy, field: str) -> bool:
    """An elastic strategy's ``join`` or ``rejoin``: its own value, else what the launcher carried
    (`ElasticConfig.resolved`); False for a strategy that is not elastic."""
    config = getattr(strategy, "elastic_config", None)
    return config is not None and bool(getattr(config.resolved(), field))


class _DynaTrainCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--print-plan", "--print_plan", dest="print_plan", action="store_true",
                            help="print the layout policy's prediction for this config (memory per device, step "
                                 "time, tokens/s, the best layout on these devices) and exit without training: "
                                 "status 0 when the layout fits, 1 when it cannot run")
        parser.add_argument("--plan.memory_gb", type=float, default=80.0,
                            help="with --print-plan: memory of one device, GB (default 80)")
        parser.add_argument("--plan.tflops", type=float, default=989.0,
                            help="with --print-plan: peak TFLOP/s of one device in the compute dtype (default 989)")
        parser.add_argument("--plan.mfu", type=float, default=0.4,
                            help="with --print-plan: the fraction of peak training reaches (default 0.4)")

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        if config is None or not config.get("print_plan"):
            return
        from dynatrain.cli.print_plan import DeviceSpec, format_plan, plan_recipe

        try:
            plan = plan_recipe(config, DeviceSpec(config.plan.memory_gb, config.plan.tflops, config.plan.mfu))
        except ValueError as e:
            print(f"dynatrain {self.subcommand}: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        print(format_plan(plan))
        raise SystemExit(0 if plan.fits else 1)  # a script can gate a submission on it

    def _check(self) -> None:
        try:
            check_layout(self.trainer, self.model, self.datamodule)
        except ValueError as e:
            print(f"dynatrain {self.subcommand}: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    before_fit = before_validate = before_test = _check


def _stay_as_standby() -> None:
    """A process that left the job becomes one of its standby processes: the same process, started over as
    `dynatrain join`, so it registers again and waits for the next scale-out instead of exiting."""
    import sys

    print(f"dynatrain: process {os.getpid()} left the job; it waits as a standby process for the next scale-out",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    from dynatrain.cli.devices import own_device

    # Its device stays its own (the launcher gives it to no other process while this one lives): the only visible
    # one, since `dynatrain join` without a local rank trains on the first it sees.
    visible = own_device(None, os.environ)
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        os.environ.pop(key, None)
    os.execv(sys.executable, [sys.executable, "-m", "dynatrain.cli", "join"])


def run_lightning_cli(argv: list[str]) -> int:
    import dynatrain  # noqa: F401  (registers strategy="dynatrain" in this and every re-launched process)
    from dynatrain.data import LlamaDataModule
    from dynatrain.lm.causal_lm import CausalLM

    from dynatrain.cli.quiet import quiet_libraries
    from dynatrain.runtime.memory import freeze_import_time_objects

    os.environ.setdefault("WANDB_MODE", "offline")
    quiet_libraries()
    # The imports are done and no model, data module or Trainer exists yet: keep the objects of torch's and
    # Lightning's imports out of every later collection (a switch's run 0.15 s shorter each; `--no-gc-freeze`).
    freeze_import_time_objects()
    cli = _DynaTrainCLI(
        CausalLM,
        LlamaDataModule,
        args=argv,
        trainer_defaults={"strategy": "dynatrain", "accelerator": "auto", "use_distributed_sampler": False},
        save_config_kwargs={"overwrite": True},
        seed_everything_default=1234,
        # The program's name in usage lines and tips: a training command restarts itself as `python -m dynatrain.cli`.
        parser_kwargs={"prog": "dynatrain"},
    )
    trainer = cli.trainer
    if getattr(trainer.strategy, "detached", False) and _elastic(trainer.strategy, "rejoin"):
        _stay_as_standby()
    if trainer.is_global_zero and argv and argv[0] == "fit":
        losses = getattr(cli.model, "step_losses", [])
        if losses:
            rank_zero_info(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f} over {len(losses)} steps")
        for logger in trainer.loggers:
            rank_zero_info(_where(logger))
        _summarise_switches(trainer)
    del cli, trainer
    teardown_distributed()
    return 0

