"""`DynaTrainStrategy`: Lightning glue around a (dp_replicate, dp_shard, tp) device mesh.

Built on Lightning's `ModelParallelStrategy` for process-group set-up, DCP checkpoints and the launcher;
it owns the mesh layout (`parallel`), keeps the global batch fixed through gradient accumulation, and
applies a ``parallelize_fn`` (by default the zoo's, for the dynatrain `Transformer`s a module holds) when the
LightningModule does not parallelise its model in `configure_model`. It never names a model class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from dynatrain.runtime.control_group import new_control_group
from dynatrain.elastic import priority
from dynatrain.elastic.manager import JOIN_CHECKPOINT, ElasticConfig, ElasticManager, JobEnded, member_info
from dynatrain.engine.placed_sums import warm_up as warm_up_switch_check
from dynatrain.runtime.lightning_version import check_lightning_version
from dynatrain.models.auto_parallel import AutoOptions, mp_policy_for, parallelize_default
from dynatrain.models.checkpointing import ActivationCheckpointing
from dynatrain.models.compile import compile_backend
from dynatrain.models.context_parallel import check_context_parallel
from dynatrain.models.parallelize import (
    ParallelizeOptions,
    connect_mesh_groups,
    init_mesh,
    materialize_model,
    mesh_groups,
)
from dynatrain.models.registry import zoo_config_of
from dynatrain.strategies.checkpoint_io import CheckpointIO
from dynatrain.strategies.data_split import DataSplit
from dynatrain.strategies.fit_loop import resume_from_when_none
from dynatrain.strategies.lightning_compat import lightning_sizes, refuse_fsdp1
from dynatrain.strategies.lightning_world import adopt_logger_versions, forget_old_meshes, logger_versions, set_world
from dynatrain.strategies.pipeline_runner import PipelineRunner, check_schedule
from dynatrain.strategies.steps import CompileWatch, StepHooks
from dynatrain.switch.target import ModuleTemplate, to_meta
from dynatrain.vps.parallel_config import ParallelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name: str | None, what: str) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"{what}={name!r} is not supported; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _prepare_data_locally(trainer: Trainer) -> None:
    datamodule = trainer.datamodule
    if datamodule is not None and is_overridden("prepare_data", datamodule):
        datamodule.prepare_data()


class DynaTrainStrategy(StepHooks, CheckpointIO, ModelParallelStrategy):
    """FSDP2 + tensor parallelism on a ``(dp_replicate, dp_shard, tp)`` mesh.

    Args:
        parallel: ``"auto"`` or a layout such as ``"dp_replicate=2,dp_shard=2,tp=2"`` (missing terms are 1).
        sequence_parallel: shard activations along the sequence between TP regions.
        param_dtype: FSDP2 mixed precision: dtype parameters are gathered in (``"bfloat16"``), or None.
        reduce_dtype: FSDP2 mixed precision: dtype of the gradient reduce-scatter.
        verify_switches: check every layout switch bitwise: each moved element hashed where it was sent and where
            it landed, indexed by its tensor's own placements, never by the plan; what stayed checked by its
            indices; optimizer scalars and LR schedulers hashed whole (see `dynatrain.switch.verify`). Its seconds
            are the report's ``verify`` phase.
        switch_budget_mb: transient memory per rank for a layout switch beyond holding the state once: half
            stages a round's send + receive buffers, half holds the states in flight (see docs/planner.md).
        rank_map: how a switch places processes on the new mesh: ``"optimal"`` (fewest bytes on the wire),
            ``"identity"``, or ``"auto"``: the fewest bytes, except that a switch within the world keeps the default
            arrangement, whose target it built at the request, when the bytes that saves cost less wire time (as
            the job's switches measured it) than building the target again for another arrangement.
        save_distributed_checkpoint: one DCP shard per rank (True) or a full checkpoint on rank 0.
        elastic: let the job change its processes (``True``, a dict of `ElasticConfig` fields, or one):
            processes leave and join through the job's store (see docs/elastic.md).
        parallelize_fn: ``fn(module, mesh, layout)`` that parallelises a LightningModule without
            `configure_model()` for a layout (torchtitan's style); by default the zoo's for the dynatrain
            `Transformer`s the module holds, else FSDP2 on each repeated block then on each child that holds
            parameters, with tensor parallelism from the model's plan when tp > 1 (`models.auto_parallel`). Also what
            `parallelize()` applies.
        block_types: classes (or class names) whose modules the default parallelisation shards as one FSDP2 unit
            each; by default a Hugging Face model's ``_no_split_modules``, else the element class of the largest
            ``nn.ModuleList``.
        tp_plan: for the default parallelisation with tp > 1: module-name patterns (from the LightningModule,
            ``*`` for one name part) to ``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"``,
            ``"embedding_rowwise"``, ``"sequence_parallel"``; by default the plan a Hugging Face model carries
            (``_tp_plan``). A layout the plan cannot serve is refused when requested, with the reason.
        reshard_after_forward: the default parallelisation frees gathered parameters after each block's forward
            (False keeps them until backward: more memory, fewer all-gathers). Its FSDP2 mixed precision follows
            Lightning's ``precision`` (``"bf16-mixed"``: bf16 parameters, fp32 reduction) unless ``param_dtype`` is
            given.
        data_parallel_size, tensor_parallel_size: as in Lightning's ``ModelParallelStrategy``, instead of
            ``parallel``: when either is given, the other defaults to ``"auto"``, which is the number of nodes for
            data parallelism (FSDP over ``dp_shard``) and the devices of one node for tensor parallelism. The mesh
            is dynatrain's ``(dp_replicate, dp_shard, tp)``; ``device_mesh["data_parallel"]`` and
            ``["tensor_parallel"]`` answer as Lightning's do, but ``mesh_dim_names`` lists dynatrain's names.
        loss_parallel: with tp > 1 the default parallelisation leaves the logits split over the vocabulary, and a
            module that computes its loss under `torch.distributed.tensor.parallel.loss_parallel` (the zoo's
            `CausalLM` does) never gathers them whole; False gathers them on every rank.
        pipeline_schedule: with pp > 1, ``"1F1B"``, ``"GPipe"`` or ``"Interleaved1F1B"`` (several stages per rank).
        stages_per_rank: pipeline stages each pp rank runs (>= 2 with Interleaved1F1B, else 1).
        activation_checkpointing: ``"none"``, ``"full"`` (every block recomputes its forward in the backward),
            ``"selective:N"`` (every N-th block) or ``"selective:op"`` (every block keeps its attention, collective
            and every other matmul outputs); parameter names stay those of the plain model (see
            `dynatrain.models.checkpointing`).
        compile: `torch.compile` each transformer block: False, True (inductor) or a backend name (``"aot_eager"``).
            A switch's target blocks compile at its first step; `SwitchReport.compile_s` says how long that took.
        check_batches: the ranks of each data-parallel rank (a tp, pp or cp group) compare a fingerprint of every
            micro-batch and stop with the ranks and step when they differ; by default only the first micro-batch
            after each switch is compared.
        Checkpointing and compile apply to the default parallelisation (the zoo's models); a ``parallelize_fn`` or a
        `configure_model()` of your own calls `dynatrain.models.checkpointing.apply_ac` and
        `dynatrain.models.compile.apply_compile` itself (between TP and FSDP) or reads them from the strategy.
    """

    strategy_name = "dynatrain"

    def __init__(
        self,
        parallel: str | ParallelConfig = "auto",
        sequence_parallel: bool = False,
        param_dtype: str | None = None,
        reduce_dtype: str | None = "float32",
        verify_switches: bool = True,
        switch_budget_mb: float = 256.0,
        rank_map: str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        elastic: ElasticConfig | dict | bool | None = None,
        parallelize_fn: Callable[[nn.Module, DeviceMesh, ParallelConfig], Any] | None = None,
        pipeline_schedule: str = "1F1B",
        stages_per_rank: int = 1,
        loss_parallel: bool = True,
        activation_checkpointing: str = "none",
        compile: bool | str = False,
        check_batches: bool = False,
        block_types: Sequence[type | str] = (),
        tp_plan: dict[str, str] | None = None,
        reshard_after_forward: bool = True,
        data_parallel_size: int | str | None = None,
        tensor_parallel_size: int | str | None = None,
    ) -> None:
        check_lightning_version()  # the loop integration (`fit_loop`) relies on this range's internals
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._parallel_request = parallel if parallel == "auto" else ParallelConfig.parse(parallel)
        self._lightning_sizes = lightning_sizes(parallel, data_parallel_size, tensor_parallel_size)
        self.sequence_parallel = sequence_parallel
        param = _dtype(param_dtype, "param_dtype")
        reduce = _dtype(reduce_dtype, "reduce_dtype")
        self.mp_policy = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce) if param is not None else None
        check_schedule(pipeline_schedule, stages_per_rank)
        self.pipeline_schedule, self.stages_per_rank = pipeline_schedule, stages_per_rank
        # Read by the zoo's parallelisation, for the first model and every switch's target alike.
        self.activation_checkpointing = ActivationCheckpointing.parse(activation_checkpointing)
        self.compile_backend = compile_backend(compile)
        self.auto_options = AutoOptions(tuple(block_types), tp_plan, None, reshard_after_forward)
        self.parallelize_fn = parallelize_fn or self._parallelize_default
        self.parallelize_options = ParallelizeOptions(
            mp_policy=self.mp_policy, sequence_parallel=sequence_parallel, stages_per_rank=stages_per_rank,
            loss_parallel=loss_parallel, activation_checkpointing=self.activation_checkpointing,
            compile_backend=self.compile_backend)
        self.loss_parallel = loss_parallel
        self.pipeline: PipelineRunner | None = None  # the schedule of this rank's stages when pp > 1
        self.verify_switches = verify_switches
        if switch_budget_mb <= 0:
            raise ValueError(f"switch_budget_mb must be positive, got {switch_budget_mb}")
        self.switch_budget_bytes = int(switch_budget_mb * 2**20)
        if rank_map not in ("auto", "optimal", "identity"):
            raise ValueError(f"rank_map={rank_map!r}: use 'auto', 'optimal' or 'identity'")
        self.rank_map = rank_map
        self.parallel_config: ParallelConfig | None = None
        # positions[i] is the process at mesh position i (default order (r*S + s)*T + t); a switch may permute it.
        self.positions: list[int] | None = None
        self.switch_reports: list = []
        self.recovery_reports: list = []  # processes lost while training, and how the survivors went on
        self._switcher = None
        self._meshes: dict[tuple, DeviceMesh] = {}
        # The current world's gloo group for metadata (`dynatrain.runtime.control_group`); training's groups carry device tensors.
        self.control_group = None
        self.retire_groups: bool | None = None  # see retire_meshes
        self.elastic_config = ElasticConfig.parse(elastic)
        self.elastic: ElasticManager | None = None
        self.detached = False  # this process left the job: collectives become local no-ops
        self.local_only = False  # a joiner before training starts: Lightning's start-up collectives stay local
        self._device: torch.device | None = None
        # Called on every rank before a switch moves any state (e.g. to finish an in-flight asynchronous
        # snapshot, whose background collectives would otherwise meet the old groups being torn down).
        self.switch_guards: list = []
        # Called with the SwitchReport once a switch completed, on every process of the new world and on a process
        # that left (its report's world_size is 0).
        self.after_switch: list = []
        self.check_batches = check_batches
        self.data_split = DataSplit(self)  # the data-parallel split of every dataloader, through every switch
        self.compile_watch = CompileWatch() if self.compile_backend else None
        if self.compile_watch is not None:
            self.after_switch.append(self.compile_watch.on_switch)
        self._template: ModuleTemplate | None = None  # the LightningModule before configure_model(), on meta
        self._target_mesh: DeviceMesh | None = None  # set while a target layout is built
        # The job's layout policy for a number of processes (set by dynatrain.callbacks.ElasticCallback): what the
        # survivors of a lost process go on with.
        self.layout_chooser = None

    # ---- layout -------------------------------------------------------------------------------------------
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
        if self.elastic_config is None:
            self._setup_distributed()
            self.form_control_group()
        else:
            self._setup_elastic()
            if self.parallel_config is not None:  # a joiner: its layout came with the switch it joined
                return
        # Not a joiner after all (a `dynatrain join` whose strategy is not elastic starts a job of its own): never
        # train at a standby's priority.
        priority.restore()
        self.parallel_config = self._resolve_layout()
        self.positions = list(range(self.parallel_config.world_size))
        self._device_mesh = self.build_mesh(self.parallel_config)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _setup_elastic(self) -> None:
        """Form generation 0 of an elastic job, or, in a joining process, enter the running job."""
        self.accelerator.setup_device(self.root_device)  # what Strategy.setup_environment does
        self._device = self.root_device
        self._process_group_backend = self._get_process_group_backend()
        self.elastic = ElasticManager(self.elastic_config, self._process_group_backend)
        self.elastic.end_at_exit()
        if self.elastic.joining:
            self.local_only = True
            trainer = self.lightning_module.trainer
            # Lightning brackets prepare_data with a barrier on a new group of the whole world; the members
            # passed theirs long ago, so a joiner prepares its node's data alone.
            trainer._data_connector.prepare_data = lambda: _prepare_data_locally(trainer)
            resume_from_when_none(trainer, JOIN_CHECKPOINT)
            self._install_switcher(None)
            try:
                self._switcher.join()
            except JobEnded as e:
                # Under a launcher that keeps a node's processes until they exit (torchrun), a clean end.
                print(f"dynatrain: {e}; this process exits", flush=True)
                raise SystemExit(0) from None
            self.lightning_module._device_mesh = self._device_mesh
            return
        self.set_world_ranks()
        world = self.elastic.start(self.global_rank, self.world_size, self.member_info())
        set_world(self, world.rank, world.world_size)
        # Every member learns the run's logger versions now, so whichever becomes rank 0 writes into the same run.
        trainer = self.lightning_module.trainer
        versions = logger_versions(trainer) if world.rank == 0 else None
        adopt_logger_versions(trainer, self.broadcast(versions))

    def teardown(self) -> None:
        if self.elastic is not None and self.elastic.world is not None and not self.detached \
                and self.global_rank == 0:
            self.elastic.finish()
        super().teardown()

    def form_control_group(self) -> None:
        """Right after a world forms, on every rank: a collective on the default group, so that its first operation
        is one every rank joins (NCCL sets a communicator up at its first use and waits for every rank there; the
        first could otherwise be a switch's send, which a rank with nothing to send never posts), then the world's
        control group."""
        if not dist.is_initialized():
            self.control_group = None
            return
        dist.all_reduce(torch.zeros(1, device=self.root_device))
        timeout = timedelta(seconds=self.elastic.config.timeout) if self.elastic is not None else self._timeout
        self.control_group = new_control_group(timeout)

    def member_info(self) -> dict:
        from dynatrain.runtime.version import __version__

        return member_info(self.model_config(), __version__)

    @property
    def root_device(self) -> torch.device:
        # An elastic process keeps its device while its rank and the world around it change.
        return self._device if self._device is not None else super().root_device

    def build_mesh(self, pcfg: ParallelConfig, ranks=None) -> DeviceMesh:
        """The mesh of a layout and rank arrangement, built once per world and reused when a switch returns to it.

        Reuse keeps the number of process groups bounded by the layouts visited; every rank takes the same
        branch (the key is rank-identical), so group creation stays in step everywhere.
        """
        key = (pcfg, tuple(range(pcfg.world_size)) if ranks is None else tuple(int(r) for r in ranks))
        mesh = self._meshes.get(key)
        if mesh is None:
            # Also under Lightning's own names, so a configure_model written for ModelParallelStrategy runs unchanged.
            mesh = init_mesh(pcfg, self.root_device.type, key[1])
            # Before the first step: a layout's first collectives should not carry its communicators' set-up.
            connect_mesh_groups(mesh, pcfg, self.root_device)
            self._meshes[key] = mesh
        return mesh

    def install_layout(self, mesh: DeviceMesh, pcfg: ParallelConfig, positions) -> None:
        """Run on ``mesh`` as ``pcfg`` (``positions``: the rank at each mesh position) from now on."""
        self._device_mesh = mesh
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = mesh
        self.parallel_config, self.positions = pcfg, list(positions)

    def retire_meshes(self, keep: Callable[[ParallelConfig], bool] = lambda layout: False) -> int:
        """Destroy the process groups of this world's meshes but the running one and those of the layouts ``keep``
        names (a build kept for a switch to come); returns how many groups went.

        An NCCL group holds its communicator's buffers on the device for as long as it lives, and a job that wanders
        through layouts would keep them all; destroying it shuts the communicator down. A layout visited again is
        connected again when its switch builds it, before the stall. Gloo's connections close only when the last
        reference to the group goes, and torch keeps some of a mesh's (6 file descriptors more per switch on 2
        ranks, measured): there the meshes stay and are reused instead, bounded by the layouts visited.
        ``retire_groups`` (None: on NCCL) decides. Every rank calls this at the same point after a switch, when no
        operation on an old group is pending; destroying a group is local."""
        if not dist.is_initialized() or self._device_mesh is None:
            return 0
        if not (self.retire_groups if self.retire_groups is not None else "nccl" in str(dist.get_backend())):
            return 0
        live = {id(dist.group.WORLD)}
        kept = {key: mesh for key, mesh in self._meshes.items() if mesh is self._device_mesh or keep(key[0])}
        for key, mesh in kept.items():
            live.update(id(g) for g in mesh_groups(mesh, key[0], min_size=1))
        retired = 0
        for key in [k for k in self._meshes if k not in kept]:
            for group in mesh_groups(self._meshes.pop(key), key[0], min_size=1):
                if id(group) not in live:
                    live.add(id(group))  # two meshes may share a group: destroy it once
                    dist.destroy_process_group(group)
                    retired += 1
        if retired:
            forget_old_meshes()
        return retired

    def forget_meshes(self, drop_groups: bool = False) -> None:
        """Forget every mesh of this world, the current one included (its world is gone). ``drop_groups``: also
        empty their process-group registries and DTensor's caches, so that a broken world's groups go with their
        last reference."""
        if drop_groups:
            for mesh in [*self._meshes.values(), self._device_mesh]:
                for m in (mesh, getattr(mesh, "_root_mesh", None)):
                    registry = getattr(m, "_pg_registry", None)
                    if registry is not None:
                        registry.clear()
            forget_old_meshes()
        self._meshes.clear()
        self._device_mesh = None
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = None

    def placeholder_module(self) -> nn.Module | None:
        """An unparallelised copy of the module on meta (for a process that left the job to hold), if kept."""
        return self._template.fresh() if self._template is not None else None

    # ---- model --------------------------------------------------------------------------------------------
    def parallelize(self, model: nn.Module, mesh: DeviceMesh | None = None, pcfg: ParallelConfig | None = None
                    ) -> nn.Module:
        """Apply ``parallelize_fn`` to a model for a layout (default: the current one, or the target a switch is
        building)."""
        mesh = mesh or self._target_mesh or self.device_mesh
        pcfg = pcfg or self.parallel_config
        assert pcfg is not None
        return self.parallelize_fn(model, mesh, pcfg)

    def _parallelize_default(self, module: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> nn.Module:
        # Lightning's precision is only known once the trainer has connected its plugin: read it at each build.
        precision = getattr(self.precision_plugin, "precision", None)
        options = replace(self.auto_options, mp_policy=mp_policy_for(precision, self.mp_policy))
        return parallelize_default(module, mesh, pcfg, self.parallelize_options, options)

    @contextmanager
    def model_sharded_context(self):
        # Entered right before Lightning calls configure_model(): the module as the user built it is the template
        # every target layout is parallelised from.
        self._keep_template()
        if self._joining:
            # A joining process receives every value; its parallelisation must not scatter initial weights with
            # collectives the members are not part of, so it runs on meta, as a target layout does.
            to_meta(self.lightning_module)
        with super().model_sharded_context(), torch.device("meta") if self._joining else nullcontext():
            yield

    def _keep_template(self) -> None:
        module = self.lightning_module
        if self._template is None and module is not None:
            self._template = ModuleTemplate(module, keep=(module._trainer,))

    def build_target(self, mesh: DeviceMesh, pcfg: ParallelConfig):
        """A copy of the LightningModule parallelised for ``pcfg`` on ``mesh`` by the user's own configure_model()
        (or the strategy's ``parallelize_fn``), on the meta device."""
        if self._template is None:
            raise ValueError("the LightningModule was not set up by this strategy's fit, so its parallelisation "
                             "cannot be run again for another layout")

        def parallelize(module) -> None:
            if is_overridden("configure_model", self.lightning_module):
                with self.precision_plugin.module_init_context():
                    module.configure_model()
            else:
                self.parallelize(module)

        # While the target is built, the strategy answers with its layout, as the module's mesh does.
        self._target_mesh, current = mesh, self.parallel_config
        self.parallel_config = pcfg
        try:
            target = self._template.build(mesh, parallelize)
        finally:
            self._target_mesh, self.parallel_config = None, current
        check_context_parallel(target, pcfg)
        return self.precision_plugin.convert_module(target)

    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        refuse_fsdp1(self.model, type(self).__name__)
        self._keep_template()
        if not is_overridden("configure_model", self.lightning_module):
            self.parallelize(self.model)
        check_context_parallel(self.model, self.parallel_config)
        seq_len = getattr(getattr(trainer, "datamodule", None), "seq_len", None)
        if self.parallel_config is not None and self.parallel_config.cp > 1 and isinstance(seq_len, int):
            self.parallel_config.sequence_chunk(seq_len)  # refused here rather than in the first forward
        joining = self._joining
        if joining:
            self._switcher.adopt_joined_module()  # the members wait in the transfer, whatever this module holds
        else:
            for module in self.model.modules():
                # torchtitan's convention: a model that initialises itself independently of its layout.
                if callable(getattr(module, "init_weights", None)) and any(p.is_meta for p in module.parameters()):
                    materialize_model(module, self.root_device)
            # A model the user built on meta: initialised by its reset_parameters(), as ModelParallelStrategy does.
            _materialize_distributed_module(self.model, self.root_device)
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
            _optimizers_to_device(self.optimizers, self.root_device)
            if self.verify_switches:
                warm_up_switch_check()  # its one-time set-up, here rather than in the first switch's stall
        self.build_pipeline()

    def _set_accumulation(self, trainer: Trainer) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "accumulation_for"):
            trainer.accumulate_grad_batches = datamodule.accumulation_for(self.dp_size)

    # ---- layout switches ----------------------------------------------------------------------------------
    def _install_switcher(self, trainer: Trainer | None) -> None:
        from dynatrain.strategies.switcher import Switcher

        if self._switcher is None:
            self._switcher = Switcher(self)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._switcher.attach(trainer)

    def materialize(self, model: nn.Module) -> None:
        """Give a meta-device model its initialised weights (its ``init_weights``). A target layout being built,
        or a joining process, keeps it on meta: the switch fills it with the moved shards."""
        if self._target_mesh is not None or self._joining:
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

    # ---- collectives of a process outside the training world ----------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if not (self.detached or self.local_only):
            super().barrier(name)

    def broadcast(self, obj, src: int = 0):
        if self.detached or self.local_only:
            return obj
        return super().broadcast(obj, src)

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if self.detached or self.local_only:
            return tensor
        return super().reduce(tensor, group, reduce_op)

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        if self.detached or self.local_only:
            return tensor.unsqueeze(0)
        return super().all_gather(tensor, group, sync_grads)

    def switch(self, target: str | ParallelConfig, *, rank_map: str | None = None, budget_mb: float | None = None):
        """Move model and optimizer state to the layout ``target`` now. Only at an optimizer-step boundary;
        every rank calls it with the same arguments. Returns a `SwitchReport`."""
        return self._switcher.switch(target, rank_map=rank_map, budget_mb=budget_mb)


if DynaTrainStrategy.strategy_name not in StrategyRegistry:
    # Importing the strategy makes strategy="dynatrain" work (see `dynatrain.strategies.registration`).
    StrategyRegistry.register(DynaTrainStrategy.strategy_name, DynaTrainStrategy,
                              description="FSDP2 + tensor parallelism with online layout switching")
