"""`DynaTrainStrategy`: Lightning glue around a (dp_replicate, dp_shard, tp) device mesh.

Built on Lightning's `ModelParallelStrategy` for process-group set-up, DCP checkpoints and the launcher;
it owns the mesh layout (`parallel`), keeps the global batch fixed through gradient accumulation, and
applies a ``parallelize_fn`` (by default the zoo's, for the dynatrain `Transformer`s a module holds) when the
LightningModule does not parallelise its model in `configure_model`. It never names a model class. Its meshes are a
`MeshCache`, an elastic job's first world is an `ElasticSetup`'s, and a target layout is a `TargetBuilder`'s build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh

from dynatrain.check.hashing import warm_up as warm_up_switch_check
from dynatrain.elastic import priority
from dynatrain.elastic.manager import ElasticConfig, ElasticManager, member_info
from dynatrain.elastic.next_world import world_control_group
from dynatrain.engine import run_transition
from dynatrain.models.auto_parallel import AutoOptions, mp_policy_for, parallelize_default
from dynatrain.models.context_parallel import check_context_parallel
from dynatrain.models.parallelize import ParallelizeOptions, materialize_model
from dynatrain.models.registry import zoo_config_of
from dynatrain.runtime.lightning_version import check_lightning_version
from dynatrain.strategies.checkpoint_io import CheckpointIO
from dynatrain.strategies.data_split import DataSplit
from dynatrain.strategies.elastic_setup import ElasticSetup
from dynatrain.strategies.lightning_compat import lightning_sizes, refuse_fsdp1
from dynatrain.strategies.lightning_internals import (
    materialize_distributed_module,
    optimizers_to_device,
    process_group_timeout,
    set_module_mesh,
    settle_process_group_backend,
    setup_distributed,
)
from dynatrain.strategies.mesh_cache import MeshCache
from dynatrain.strategies.options import DataOptions, ParallelismOptions, SwitchingOptions, parse_option
from dynatrain.strategies.outside_world import OutsideWorldCollectives
from dynatrain.strategies.pipeline_runner import PipelineRunner
from dynatrain.strategies.steps import CompileWatch, StepHooks
from dynatrain.strategies.target_build import TargetBuilder
from dynatrain.switch.target import to_meta
from dynatrain.vps.parallel_config import ParallelConfig


class DynaTrainStrategy(StepHooks, CheckpointIO, OutsideWorldCollectives, ModelParallelStrategy):
    """FSDP2 + tensor parallelism on a ``(dp_replicate, dp_shard, tp)`` mesh.

    Args:
        parallel: ``"auto"`` or a layout such as ``"dp_replicate=2,dp_shard=2,tp=2"`` (missing terms are 1).
        data_parallel_size, tensor_parallel_size: as in Lightning's ``ModelParallelStrategy``, instead of
            ``parallel``: when either is given, the other defaults to ``"auto"``, which is the number of nodes for
            data parallelism (FSDP over ``dp_shard``) and the devices of one node for tensor parallelism. The mesh
            is dynatrain's ``(dp_replicate, dp_shard, tp)``; ``device_mesh["data_parallel"]`` and
            ``["tensor_parallel"]`` answer as Lightning's do, but ``mesh_dim_names`` lists dynatrain's names.
        save_distributed_checkpoint: one DCP shard per rank (True) or a full checkpoint on rank 0.
        process_group_backend, timeout: of the training world's process groups, as in ``ModelParallelStrategy``.
        parallelize_fn: ``fn(module, mesh, layout)`` that parallelises a LightningModule without
            `configure_model()` for a layout (torchtitan's style); by default the zoo's for the dynatrain
            `Transformer`s the module holds, else FSDP2 on each repeated block then on each child that holds
            parameters, with tensor parallelism from the model's plan when tp > 1 (`models.auto_parallel`). Also what
            `parallelize()` applies.
        parallelism: how the default parallelisation builds a layout: sequence parallelism, mixed precision, the
            pipeline schedule, loss parallelism, activation checkpointing, compile, FSDP2 units and the TP plan
            (a `ParallelismOptions` or a dict of its fields).
        switching: how a layout switch runs: its bitwise check, memory budget and rank placement (a
            `SwitchingOptions` or a dict of its fields).
        data: what the data split checks (a `DataOptions` or a dict of its fields).
        elastic: let the job change its processes (``True``, a dict of `ElasticConfig` fields, or one):
            processes leave and join through the job's store (see docs/elastic.md).
    """

    strategy_name = "dynatrain"

    def __init__(
        self,
        parallel: str | ParallelConfig = "auto",
        data_parallel_size: int | str | None = None,
        tensor_parallel_size: int | str | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        parallelize_fn: Callable[[nn.Module, DeviceMesh, ParallelConfig], Any] | None = None,
        parallelism: ParallelismOptions | Mapping | None = None,
        switching: SwitchingOptions | Mapping | None = None,
        data: DataOptions | Mapping | None = None,
        elastic: ElasticConfig | dict | bool | None = None,
    ) -> None:
        check_lightning_version()  # the loop integration (`fit_loop`) relies on this range's internals
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._parallel_request = parallel if parallel == "auto" else ParallelConfig.parse(parallel)
        self._lightning_sizes = lightning_sizes(parallel, data_parallel_size, tensor_parallel_size)
        self.parallelism = parse_option(ParallelismOptions, parallelism, "parallelism")
        self.switching = parse_option(SwitchingOptions, switching, "switching")
        self.data_options = parse_option(DataOptions, data, "data")
        self.elastic_config = ElasticConfig.parse(elastic)
        self.parallelize_fn = parallelize_fn or self._parallelize_default
        self.pipeline: PipelineRunner | None = None  # the schedule of this rank's stages when pp > 1
        self.parallel_config: ParallelConfig | None = None
        # positions[i] is the process at mesh position i (default order (r*S + s)*T + t); a switch may permute it.
        self.positions: list[int] | None = None
        self.switch_reports: list = []
        self.join_report = None  # the switch by which this process joined the job, if it did (`SwitchReport.joined`)
        self.recovery_reports: list = []  # processes lost while training, and how the survivors went on
        self._switcher = None
        # What moves a switch's bytes: the engine's transfer, or the one fault injection or a benchmark hands in.
        self.switch_transfer = run_transition
        self.meshes = MeshCache()
        # The current world's gloo group for metadata (`dynatrain.runtime.control_group`); training's groups carry
        # device tensors.
        self.control_group = None
        self.elastic: ElasticManager | None = None
        self.elastic_setup = ElasticSetup(self, self.elastic_config, self._join_running_job) \
            if self.elastic_config is not None else None
        self.detached = False  # this process left the job: collectives become local no-ops
        self.local_only = False  # a joiner before training starts: Lightning's start-up collectives stay local
        self._device: torch.device | None = None
        # Called on every rank before a switch moves any state (e.g. to finish an in-flight asynchronous
        # snapshot, whose background collectives would otherwise meet the old groups being torn down).
        self.switch_guards: list = []
        # Called with the SwitchReport once a switch completed, on every process of the new world and on a process
        # that left (its report's world_size is 0).
        self.after_switch: list = []
        self.data_split = DataSplit(self)  # the data-parallel split of every dataloader, through every switch
        self.compile_watch = CompileWatch() if self.parallelism.compile_backend else None
        if self.compile_watch is not None:
            self.after_switch.append(self.compile_watch.on_switch)
        self.targets = TargetBuilder(self)
        # The job's layout policy for a number of processes (set by dynatrain.callbacks.ElasticCallback): what the
        # survivors of a lost process go on with.
        self.layout_chooser = None

    # ---- layout -------------------------------------------------------------------------------------------
    @property
    def parallelize_options(self) -> ParallelizeOptions:
        """What the zoo's parallelisation (its spec's ``parallelize_fn``) reads of this strategy's options."""
        return self.parallelism.parallelize_options

    @property
    def parallel_request(self) -> str | ParallelConfig:
        """The layout asked for at construction: ``"auto"`` or a `ParallelConfig`."""
        return self._parallel_request

    @property
    def dp_size(self) -> int:
        return self.parallel_config.dp_size if self.parallel_config else self.world_size

    @property
    def dp_rank(self) -> int:
        if self._device_mesh is None or self.parallel_config is None:
            return self.global_rank
        # Positions are row-major with tp fastest and pp slowest, whatever the root mesh's dimensions (ep splits
        # dp_shard); every stage's ranks of one data-parallel index read the same micro-batches.
        position = 0
        for index, size in zip(self._device_mesh.get_coordinate(), self._device_mesh.mesh.shape):
            position = position * int(size) + index
        return self.parallel_config.dp_rank_of(position)

    @property
    def tp_rank(self) -> int:
        if self._device_mesh is None:
            return 0
        return self._device_mesh.get_coordinate()[-1]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def process_dataloader(self, dataloader: object) -> object:
        # Lightning has injected its sampler for the current data-parallel size; from here the split follows every
        # switch (see `data_split`).
        return self.data_split.process(super().process_dataloader(dataloader))

    def model_config(self):
        """The zoo config of the module's model (the model registry knows it), None for any other model."""
        return zoo_config_of(self.lightning_module)

    def requested_layout(self, num_nodes: int, devices_per_node: int) -> ParallelConfig:
        """The layout asked for on ``num_nodes`` x ``devices_per_node`` devices, before the model is checked."""
        if self._lightning_sizes is not None:
            return ParallelConfig.from_lightning_sizes(*self._lightning_sizes, num_nodes, devices_per_node)
        if self._parallel_request == "auto":
            # Pure FSDP: the fastest layout for models whose shards fit the devices; large models pin `parallel=`.
            return ParallelConfig(dp_shard=num_nodes * devices_per_node)
        return self._parallel_request

    def _resolve_layout(self) -> ParallelConfig:
        world = self.world_size
        return self.requested_layout(self.num_nodes, world // self.num_nodes).validate(self.model_config(), world)

    def setup_environment(self) -> None:
        if self.elastic_setup is None:
            setup_distributed(self)
            self.form_control_group()
        else:
            self.accelerator.setup_device(self.root_device)  # what Strategy.setup_environment does
            self._device = self.root_device
            self.elastic_setup.start(settle_process_group_backend(self))
            if self.parallel_config is not None:  # a joiner: its layout came with the switch it joined
                return
        # Not a joiner after all (a `dynatrain join` whose strategy is not elastic starts a job of its own): never
        # train at a standby's priority.
        priority.restore()
        self.parallel_config = self._resolve_layout()
        self.positions = list(range(self.parallel_config.world_size))
        self._device_mesh = self.build_mesh(self.parallel_config)
        assert self.lightning_module is not None
        set_module_mesh(self.lightning_module, self._device_mesh)

    def teardown(self) -> None:
        if self._switcher is not None:
            self._switcher.drop_pending()
        if self.elastic_setup is not None:
            self.elastic_setup.finish()
        super().teardown()

    @property
    def group_timeout(self) -> timedelta | None:
        """The timeout of the world's process groups: the elastic job's, else the strategy's ``timeout``."""
        if self.elastic is not None:
            return timedelta(seconds=self.elastic.config.timeout)
        return process_group_timeout(self)

    def form_control_group(self) -> None:
        """Right after a world forms, on every rank: its control group (`next_world.world_control_group`)."""
        self.control_group = world_control_group(self.root_device, self.group_timeout)

    def member_info(self) -> dict:
        from dynatrain.runtime.version import __version__

        return member_info(self.model_config(), __version__)

    @property
    def root_device(self) -> torch.device:
        # An elastic process keeps its device while its rank and the world around it change.
        return self._device if self._device is not None else super().root_device

    def build_mesh(self, pcfg: ParallelConfig, ranks=None) -> DeviceMesh:
        """The mesh of a layout and rank arrangement (`MeshCache.get`)."""
        return self.meshes.get(pcfg, self.root_device, ranks)

    def install_layout(self, mesh: DeviceMesh, pcfg: ParallelConfig, positions) -> None:
        """Run on ``mesh`` as ``pcfg`` (``positions``: the rank at each mesh position) from now on."""
        self._device_mesh = mesh
        set_module_mesh(self.lightning_module, mesh)
        self.parallel_config, self.positions = pcfg, list(positions)

    def retire_meshes(self, keep: Callable[[ParallelConfig], bool] = lambda layout: False) -> int:
        """Destroy the process groups of this world's meshes but the running one and those of the layouts ``keep``
        names (`MeshCache.retire`); returns how many groups went."""
        return self.meshes.retire(self._device_mesh, keep)

    def forget_meshes(self, drop_groups: bool = False) -> None:
        """Forget every mesh of this world, the current one included (its world is gone; `MeshCache.forget`)."""
        self.meshes.forget(self._device_mesh, drop_groups)
        self._device_mesh = None
        set_module_mesh(self.lightning_module, None)

    def placeholder_module(self) -> nn.Module | None:
        """An unparallelised copy of the module on meta (for a process that left the job to hold), if kept."""
        return self.targets.placeholder()

    # ---- model --------------------------------------------------------------------------------------------
    @property
    def has_configure_model(self) -> bool:
        """Whether the LightningModule parallelises itself in `configure_model()` (else ``parallelize_fn`` does)."""
        return is_overridden("configure_model", self.lightning_module)

    def parallelize(self, model: nn.Module, mesh: DeviceMesh | None = None, pcfg: ParallelConfig | None = None
                    ) -> nn.Module:
        """Apply ``parallelize_fn`` to a model for a layout (default: the current one, or the target a switch is
        building)."""
        mesh = mesh or self.targets.mesh or self.device_mesh
        pcfg = pcfg or self.parallel_config
        assert pcfg is not None
        return self.parallelize_fn(model, mesh, pcfg)

    def _parallelize_default(self, module: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> nn.Module:
        o = self.parallelism
        # Lightning's precision is only known once the trainer has connected its plugin: read it at each build.
        mp_policy = mp_policy_for(getattr(self.precision_plugin, "precision", None), o.mp_policy)
        options = AutoOptions(o.block_types, o.tp_plan, mp_policy, o.reshard_after_forward)
        return parallelize_default(module, mesh, pcfg, self.parallelize_options, options)

    @contextmanager
    def model_sharded_context(self):
        # Entered right before Lightning calls configure_model(): the module as the user built it is the template
        # every target layout is parallelised from.
        self.targets.keep_template()
        if self._joining:
            # A joining process receives every value; its parallelisation must not scatter initial weights with
            # collectives the members are not part of, so it runs on meta, as a target layout does.
            to_meta(self.lightning_module)
        with super().model_sharded_context(), torch.device("meta") if self._joining else nullcontext():
            yield

    def build_target(self, mesh: DeviceMesh, pcfg: ParallelConfig):
        """A copy of the LightningModule parallelised for ``pcfg`` on ``mesh``, on meta (`TargetBuilder.build`)."""
        return self.targets.build(mesh, pcfg)

    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        refuse_fsdp1(self.model, type(self).__name__)
        self.targets.keep_template()
        if not self.has_configure_model:
            self.parallelize(self.model)
        check_context_parallel(self.model, self.parallel_config)
        seq_len = getattr(getattr(trainer, "datamodule", None), "seq_len", None)
        if self.parallel_config is not None and self.parallel_config.cp > 1 and isinstance(seq_len, int):
            self.parallel_config.sequence_chunk(seq_len)  # refused here rather than in the first forward
        joining = self._joining
        if joining:
            self._switcher.adopt_joined_module()  # the members wait in the transfer, whatever this module holds
        else:
            self._materialize_model()
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        self._set_accumulation(trainer)
        self._install_switcher(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if joining:
                self._switcher.adopt_joined_optimizer()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
            if self.switching.verify_switches:
                warm_up_switch_check()  # its one-time set-up, here rather than in the first switch's stall
        self.build_pipeline()

    def _materialize_model(self) -> None:
        for module in self.model.modules():
            # torchtitan's convention: a model that initialises itself independently of its layout.
            if callable(getattr(module, "init_weights", None)) and any(p.is_meta for p in module.parameters()):
                materialize_model(module, self.root_device)
        # A model the user built on meta: initialised by its reset_parameters(), as ModelParallelStrategy does.
        materialize_distributed_module(self.model, self.root_device)

    def _set_accumulation(self, trainer: Trainer) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "accumulation_for"):
            trainer.accumulate_grad_batches = datamodule.accumulation_for(self.dp_size)

    # ---- layout switches ----------------------------------------------------------------------------------
    def _install_switcher(self, trainer: Trainer | None) -> None:
        from dynatrain.strategies.switch_orchestrator import SwitchOrchestrator

        if self._switcher is None:
            self._switcher = SwitchOrchestrator(self)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._switcher.attach(trainer)

    def _join_running_job(self) -> None:
        self._install_switcher(None)
        self._switcher.join()
        set_module_mesh(self.lightning_module, self._device_mesh)

    def materialize(self, model: nn.Module) -> None:
        """Give a meta-device model its initialised weights (its ``init_weights``). A target layout being built,
        or a joining process, keeps it on meta: the switch fills it with the moved shards."""
        if self.targets.mesh is not None or self._joining:
            return
        materialize_model(model, self.root_device)

    @property
    def _joining(self) -> bool:
        """A process started with `dynatrain join`, until it trains: its state arrives with the switch."""
        return self._switcher is not None and self._switcher.joining is not None

    def at_step_boundary(self) -> bool:
        """True between two optimizer steps (where a switch may run), False inside a gradient accumulation."""
        return self._switcher is None or self._switcher.at_boundary()

    @property
    def switch_pending(self) -> bool:
        return self._switcher is not None and self._switcher.pending is not None

    def join_checkpoint(self) -> dict | None:
        """On a process started with `dynatrain join`, the loop state its switch brought; None elsewhere."""
        payload = self._switcher.join_payload if self._switcher is not None else None
        return payload.checkpoint if payload is not None else None

    def ready_standby(self) -> int | None:
        """How many standby processes (joiners registered, ready and beating) wait outside the world, the warm pool
        a scale-out admits from first, as rank 0 reads it from the store; None on other ranks and in a job that is
        not elastic."""
        if self.elastic is None or self.elastic.world is None or self.global_rank != 0:
            return None
        return len(self.elastic.ready_joiners())

    def run_pending_switch(self):
        """Run the requested switch now if it can run (at a step boundary; a scale-out needs its joiners ready);
        returns its `SwitchReport` or None. Every rank calls it at the same point."""
        return self._switcher.run_pending()

    def request_switch(self, target: str | ParallelConfig, leave: Sequence[int] = (), wait: bool = False,
                       plan_ahead: bool = False) -> ParallelConfig:
        """Switch to ``target`` at the next optimizer-step boundary (now, if training is at one).

        The target is checked at once: a layout that does not fit the devices or the model, or whose
        data-parallel size cannot keep the global batch, raises ValueError and nothing changes.
        Every rank must make the same request. In an elastic job the target may have another world size:
        ``leave`` names ranks that must go (others are chosen by the planner when the target is smaller);
        a larger target waits at step boundaries for enough ready joiners (`dynatrain join`), training on
        meanwhile, or, with ``wait=True``, holds training at the next boundary until they are ready (dropped after
        the elastic ``join_timeout`` either way). With ``plan_ahead=True``, a switch that needs no joiners (a
        scale-in, a re-layout of the same processes) is planned in the background from the request on and runs at
        the end of the next optimizer step (of the current one for a request made inside a step), training on the
        old layout meanwhile: the plan leaves the stall, at the cost of a step later.
        """
        return self._switcher.request(target, leave, wait, plan_ahead)

    def switch(self, target: str | ParallelConfig, *, rank_map: str | None = None, budget_mb: float | None = None):
        """Move model and optimizer state to the layout ``target`` now. Only at an optimizer-step boundary;
        every rank calls it with the same arguments. Returns a `SwitchReport`."""
        return self._switcher.switch(target, rank_map=rank_map, budget_mb=budget_mb)


if DynaTrainStrategy.strategy_name not in StrategyRegistry:
    # Importing the strategy makes strategy="dynatrain" work (see `dynatrain.strategies.registration`).
    StrategyRegistry.register(DynaTrainStrategy.strategy_name, DynaTrainStrategy,
                              description="FSDP2 + tensor parallelism with online layout switching")
