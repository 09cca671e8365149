"""A switch target checked once, when it is requested: against the devices, the model, the global batch and the
data (`check_target`), the elastic world (`check_world`), and the module's own parallelisation (`check_module`).
A bad target raises ValueError naming what to change, and nothing of the running job changes."""

from __future__ import annotations

from dynatrain.strategies.pipeline_runner import check_pipeline_module
from dynatrain.switch.capture import Captured, check_switchable
from dynatrain.switch.context import SwitchContext
from dynatrain.switch.states import capture_states
from dynatrain.switch.target import TargetLayouts
from dynatrain.vps.parallel_config import ParallelConfig


def check_target(strategy, trainer, target: str | ParallelConfig, world_size: int | None = None
                 ) -> ParallelConfig:
    """Parse and validate a target against the devices, the model and the global batch."""
    world_size = strategy.world_size if world_size is None else world_size
    target = ParallelConfig.parse(target).validate(strategy.model_config(), world_size)
    if target.pp > 1:
        check_pipeline_module(strategy.lightning_module)
        n_layers = getattr(strategy.model_config(), "n_layers", None)
        per_rank = strategy.parallelism.stages_per_rank
        stages = target.pp * per_rank
        if n_layers is not None and stages > n_layers:
            raise ValueError(f"{target.short()} with {per_rank} stage(s) per rank needs {stages} "
                             f"pipeline stages of at least one layer, and the model has {n_layers}: use a "
                             f"smaller pp")
    datamodule = getattr(trainer, "datamodule", None) if trainer else None
    seq_len = getattr(datamodule, "seq_len", None)
    if target.cp > 1 and isinstance(seq_len, int):
        target.sequence_chunk(seq_len)
    try:
        if datamodule is not None and hasattr(datamodule, "accumulation_for"):
            datamodule.accumulation_for(target.dp_size)
        data = getattr(strategy, "data_split", None)  # None: a strategy that owns no dataloader
        if data is not None:
            data.check(target.dp_size, _dp_ranks_kept(strategy, target, world_size))
    except ValueError as e:
        raise ValueError(f"cannot switch to {target.short()}: {e}") from None
    return target


def _dp_ranks_kept(strategy, target: ParallelConfig, world_size: int) -> bool:
    """Whether every process keeps its data-parallel rank (the same processes in the default arrangement)."""
    current = strategy.parallel_config
    if current is None or world_size != strategy.world_size:
        return False
    positions = strategy.positions or list(range(world_size))
    # A loader dynatrain cannot re-split switches in the identity arrangement: process q at position q.
    return all(current.dp_rank_of(positions.index(q)) == target.dp_rank_of(q) for q in range(world_size))


def check_world(strategy, target: ParallelConfig, leave: tuple[int, ...]) -> None:
    """A world change needs the elastic manager, known leavers and room under max_devices."""
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


def check_module(strategy, ctx: SwitchContext, targets: TargetLayouts, target: ParallelConfig,
                 probe: bool = False) -> Captured | None:
    """Refuse now what the switch could not carry: the module's states, and its parallelisation for ``target``
    (run on meta; the result is kept for the switch). Returns the states it captured (None before set-up)."""
    if getattr(strategy, "lightning_module", None) is None:
        return None  # nothing set up yet: the module is checked when the switch runs
    check_switchable(strategy.lightning_module, strategy.optimizers)
    captured = capture_states(ctx)
    targets.check(target, captured, probe=probe)
    return captured
