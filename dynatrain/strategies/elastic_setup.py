"""`ElasticSetup`: an elastic job's first world, formed by its processes through the job's store, or the running
job a process started with `dynatrain join` enters."""

from __future__ import annotations

from collections.abc import Callable

from dynatrain.elastic.manager import JOIN_CHECKPOINT, ElasticConfig, ElasticManager, JobEnded
from dynatrain.strategies.fit_loop import resume_from_when_none
from dynatrain.strategies.lightning_internals import prepare_data_alone
from dynatrain.strategies.lightning_world import adopt_logger_versions, logger_versions, set_world


class ElasticSetup:
    """``join``: enters the running job (the strategy's switcher receives the state); it raises `JobEnded` when the
    job ended before this process got in."""

    def __init__(self, strategy, config: ElasticConfig, join: Callable[[], None]) -> None:
        self.strategy = strategy
        self.config = config
        self._join = join

    def start(self, backend: str) -> None:
        """Form generation 0 of the job, or, in a joining process, enter the running job (whose switch brings the
        layout); ``backend``: of every generation's process group."""
        strategy = self.strategy
        strategy.elastic = manager = ElasticManager(self.config, backend)
        manager.end_at_exit()
        if manager.joining:
            self._enter()
            return
        strategy.set_world_ranks()
        world = manager.start(strategy.global_rank, strategy.world_size, strategy.member_info())
        set_world(strategy, world.rank, world.world_size)
        # Every member learns the run's logger versions now, so whichever becomes rank 0 writes into the same run.
        trainer = strategy.lightning_module.trainer
        versions = logger_versions(trainer) if world.rank == 0 else None
        adopt_logger_versions(trainer, strategy.broadcast(versions))

    def _enter(self) -> None:
        strategy = self.strategy
        strategy.local_only = True
        trainer = strategy.lightning_module.trainer
        # The members passed Lightning's barrier around prepare_data long ago: a joiner prepares its node's data
        # alone.
        prepare_data_alone(trainer)
        resume_from_when_none(trainer, JOIN_CHECKPOINT)
        try:
            self._join()
        except JobEnded as e:
            # Under a launcher that keeps a node's processes until they exit (torchrun), a clean end.
            print(f"dynatrain: {e}; this process exits", flush=True)
            raise SystemExit(0) from None

    def finish(self) -> None:
        """At the end of training, on rank 0 of the job's world: the job ends (standbys and joiners stop waiting)."""
        strategy, manager = self.strategy, self.strategy.elastic
        if manager is not None and manager.world is not None and not strategy.detached \
                and strategy.global_rank == 0:
            manager.finish()
