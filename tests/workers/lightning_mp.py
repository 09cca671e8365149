"""One rank running the cases of Lightning's `test_model_parallel_integration.py` (tag 2.6.5) for one world size, with
`ModelParallelStrategy` and then with `DynaTrainStrategy`, in sequence in one process group; writes each case's
outcome (None, or the traceback of its failure) as JSON. tests/test_lightning_model_parallel.py launches it.

Adaptations common to every case (each case's own are written beside it):
- launched by tests/_launch.py (one launch per world size: 1, 2 or 4 CPU processes) instead of Lightning's
  `standalone=True` runner; `min_cuda_gpus=N` -> N CPU processes.
- `accelerator="cuda"` / `"gpu"` -> `"cpu"` (`"auto"` kept: it is the CPU here); the process group is gloo.
- the `distributed` fixture destroyed the process group after each test; here it lives through all cases of the
  launch (each Trainer builds its own mesh on it; re-forming a world on the launcher's store would need another one).
  A barrier after each case keeps the ranks in step when a case fails on them.
- `tmp_path` -> a directory per case and strategy shared by the ranks (Lightning's tests broadcast rank 0's paths
  anyway), and the working directory is the launch's, so nothing is written into the repository.
- `torch.compile(...)` -> `torch.compile(..., backend="eager")`: dynamo still traces and wraps the module in its
  `OptimizedModule` (what the strategy sees), without inductor's C++ build, which costs tens of seconds per model on
  two cores and tests nothing of the strategy. (In TensorParallelModel / FSDP2Model Lightning's tests discard the
  compiled module `parallelize` returns, so there `compile=True` only runs the wrapping.)
"""

from __future__ import annotations

import argparse
import os
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, DistributedSampler
from torchmetrics.classification import Accuracy

from dynatrain.launch.local import finish_rank
from dynatrain.strategies.dynatrain import DynaTrainStrategy

warnings.filterwarnings("ignore")
STRATEGIES = {"lightning": ModelParallelStrategy, "dynatrain": DynaTrainStrategy}


# ---- Lightning's helpers, verbatim but for the compile backend and one configure_model for its three models -----------------------------------------------

class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(32, 64)
        self.w3 = nn.Linear(64, 32)

    def forward(self, x):
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def _parallelize_feed_forward_tp(model, device_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_mesh = device_mesh["tensor_parallel"]
    tp_plan = {
        "w1": ColwiseParallel(),
        "w2": ColwiseParallel(),
        "w3": RowwiseParallel(),
    }
    parallelize_module(model, tp_mesh, tp_plan)
    return model


def _parallelize_feed_forward_fsdp2(model, device_mesh):
    from torch.distributed._composable.fsdp.fully_shard import fully_shard

    dp_mesh = device_mesh["data_parallel"]
    assert dp_mesh.ndim == 1  # Hybrid-sharding not supported

    # Fully-shard each layer
    fully_shard(model.w1, mesh=dp_mesh)
    fully_shard(model.w2, mesh=dp_mesh)
    fully_shard(model.w3, mesh=dp_mesh)
    return model


def _parallelize_feed_forward_fsdp2_tp(model, device_mesh):
    model = _parallelize_feed_forward_tp(model, device_mesh)
    return _parallelize_feed_forward_fsdp2(model, device_mesh)


def _parallelize_with_compile(parallelize):
    def fn(model, device_mesh):
        model = parallelize(model, device_mesh)
        return torch.compile(model, backend="eager")

    return fn


class TemplateModel(LightningModule):
    def __init__(self, compile=False):
        super().__init__()
        self.model = FeedForward()
        self._compile = compile

    def training_step(self, batch):
        output = self.model(batch)
        return output.sum()

    def train_dataloader(self):
        dataset_size = 8
        dataset = RandomDataset(32, dataset_size)
        return DataLoader(dataset, batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())


class TensorParallelModel(TemplateModel):
    _parallelize = staticmethod(_parallelize_feed_forward_tp)

    def configure_model(self):
        parallelize = self._parallelize
        if self._compile:
            parallelize = _parallelize_with_compile(parallelize)
        parallelize(self.model, device_mesh=self.device_mesh)


class FSDP2Model(TensorParallelModel):
    _parallelize = staticmethod(_parallelize_feed_forward_fsdp2_tp)


# Lightning defines it with FSDP2Model's body, word for word.
FSDP2TensorParallelModel = FSDP2Model


class SimpleCompiledModule(LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        self._loss = nn.MSELoss()

    def configure_model(self):
        self.model = torch.compile(self.model, backend="eager")

    def training_step(self, batch, batch_idx):
        x, y = batch
        preds = self.model(x)
        return self._loss(preds, y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _compiled_model_dataloader(batch_size: int = 32, num_batches: int = 2):
    total_samples = batch_size * num_batches
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(total_samples, 32, generator=generator)
    targets = torch.randn(total_samples, 32, generator=generator)
    dataset = torch.utils.data.TensorDataset(features, targets)
    return DataLoader(dataset, batch_size=batch_size)


# ---- the cases: Lightning's test bodies, `ModelParallelStrategy` -> `S` ------------------------------------------

def test_setup_device_mesh(S, tmp_path, names=("data_parallel", "tensor_parallel")):
    """``names``: the mesh's dimension names and how it is indexed; see `setup_device_mesh_dynatrain_names`."""
    from torch.distributed.device_mesh import DeviceMesh

    for dp_size, tp_size in ((1, 4), (4, 1), (2, 2)):
        strategy = S(
            data_parallel_size=dp_size,
            tensor_parallel_size=tp_size,
        )
        trainer = Trainer(
            accelerator="auto",
            devices=4,
            strategy=strategy,
            logger=False,
            enable_checkpointing=False,
            max_steps=1,
        )

        class Model(BoringModel):
            def configure_model(self):
                device_mesh = self.device_mesh
                assert isinstance(device_mesh, DeviceMesh)
                assert device_mesh.device_type == model.device.type
                assert device_mesh.mesh_dim_names == names
                assert _size(device_mesh, 0) == dp_size
                assert _size(device_mesh, 1) == tp_size
                assert device_mesh.ndim == len(names)

        model = Model()
        trainer.fit(model)

    # Passing "auto" will select internode and intranode dimensions automatically
    strategy = S(
        data_parallel_size="auto",
        tensor_parallel_size="auto",
    )
    trainer = Trainer(
        accelerator="auto",
        devices=4,
        num_nodes=1,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        max_steps=1,
    )

    class Model(BoringModel):
        def configure_model(self):
            device_mesh = self.device_mesh
            assert device_mesh.mesh_dim_names == names
            assert _size(device_mesh, 0) == 1
            assert _size(device_mesh, 1) == 4

    model = Model()
    trainer.fit(model)


def _size(mesh, i):
    """Lightning's `device_mesh.size(i)` on its 2-D mesh; on dynatrain's 3-D mesh the same two sizes by name."""
    return mesh.size(i) if mesh.ndim == 2 else mesh[("data_parallel", "tensor_parallel")[i]].size()


def setup_device_mesh_dynatrain_names(S, tmp_path):
    """By design: the mesh of DynaTrainStrategy is (dp_replicate, dp_shard, tp), the layouts a switch moves between,
    so `mesh_dim_names`, `ndim` and `size(i)` say so, while `device_mesh["data_parallel"]` (dp_replicate x dp_shard,
    flattened) and `device_mesh["tensor_parallel"]` answer as Lightning's do (README: the one mesh-name difference).
    Lightning's case with its sizes read by those names: every other assertion kept."""
    test_setup_device_mesh(S, tmp_path, names=("dp_replicate", "dp_shard", "tp"))


def _tensor_parallel(S, tmp_path, compile, strategy_args):
    from torch.distributed._tensor import DTensor

    class Model(TensorParallelModel):
        def on_train_start(self):
            device_mesh = self.device_mesh
            optimizer = self.optimizers()
            assert all(
                tensor.device_mesh == device_mesh["tensor_parallel"] for tensor in optimizer.param_groups[0]["params"]
            )
            assert all(isinstance(weight, DTensor) for weight in self.model.parameters())
            assert self.model.w1.weight.device_mesh == device_mesh["tensor_parallel"]

            # No data sharding, all GPUs get the same input inside a TP group
            dataloader = self.trainer.train_dataloader
            assert len(dataloader) == 8 // dataloader.batch_size
            assert isinstance(dataloader.sampler, DistributedSampler)

        def training_step(self, batch):
            # All batches must be identical across TP group
            batches = self.all_gather(batch)
            assert all(torch.equal(batches[0], batches[i]) for i in range(1, len(batches)))
            return super().training_step(batch)

    trainer = Trainer(
        accelerator="auto",
        devices=2,
        strategy=S(**strategy_args),
        max_steps=2,
        enable_checkpointing=False,
        logger=False,
    )

    seed_everything(0)
    with trainer.init_module(empty_init=True):
        model = Model(compile=compile)

    trainer.fit(model)


def test_tensor_parallel(S, tmp_path, compile):
    _tensor_parallel(S, tmp_path, compile, {})


def tensor_parallel_lightning_defaults(S, tmp_path, compile):
    """By design `DynaTrainStrategy()` is pure FSDP (dp_shard = every device), where `ModelParallelStrategy()` puts
    tensor parallelism over a node's devices; so a module written for the latter runs its TP on a one-rank mesh with
    a batch per rank and Lightning's "all batches identical" fails. Lightning's defaults spelled out
    (`data_parallel_size="auto", tensor_parallel_size="auto"`, its signature's) give Lightning's layout: the case then
    holds as written."""
    _tensor_parallel(S, tmp_path, compile, {"data_parallel_size": "auto", "tensor_parallel_size": "auto"})


def test_model_parallel_single_file_checkpoint_with_compile(S, tmp_path):
    """Replicate the reporter's setup: compiled model + ModelParallel single-file checkpointing."""

    seed_everything(0)
    strategy = S(
        data_parallel_size=1,
        tensor_parallel_size=1,
        save_distributed_checkpoint=False,
    )

    trainer = Trainer(
        accelerator="auto",
        devices=1,
        strategy=strategy,
        max_steps=2,
        limit_train_batches=2,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )

    dataloader = _compiled_model_dataloader(batch_size=32, num_batches=2)

    with trainer.init_module(empty_init=True):
        model = SimpleCompiledModule()

    trainer.fit(model, dataloader)

    if trainer.is_global_zero:
        checkpoint_path = tmp_path / "compiled-model.ckpt"
        trainer.save_checkpoint(checkpoint_path)

    trainer.strategy.barrier()


def test_fsdp2_tensor_parallel(S, tmp_path, compile):
    from torch.distributed._tensor import DTensor

    class Model(FSDP2TensorParallelModel):
        def on_train_start(self):
            optimizer = self.optimizers()
            assert all(isinstance(weight, DTensor) for weight in self.model.parameters())
            assert all(isinstance(tensor, DTensor) for tensor in optimizer.param_groups[0]["params"])
            assert self.model.w1.weight.device_mesh.ndim == 2
            assert self.model.w1.weight.device_mesh.size(0) == 2
            assert self.model.w1.weight.device_mesh.size(1) == 2
            assert all(weight.device.type != "meta" for weight in self.model.parameters())
            assert all(tensor.device_mesh.ndim == 2 for tensor in optimizer.param_groups[0]["params"])
            assert all(tensor.device.type != "meta" for tensor in optimizer.param_groups[0]["params"])

            # No data sharding across TP dimension, sharding across data-parallel dimension only
            device_mesh = self.device_mesh
            dp_mesh = device_mesh["data_parallel"]
            dataloader = self.trainer.train_dataloader
            assert len(dataloader) == 8 // dataloader.batch_size // dp_mesh.size()
            assert isinstance(dataloader.sampler, DistributedSampler)

        def training_step(self, batch):
            batches = self.all_gather(batch)
            dp_mesh = self.device_mesh["data_parallel"]
            tp_mesh = self.device_mesh["tensor_parallel"]

            # Batches across the TP dimension must be identical
            batches_tp = batches[tp_mesh.mesh]
            assert all(torch.equal(batches_tp[0], batches_tp[i]) for i in range(1, len(batches_tp)))
            # Batches across the DP dimension must be different
            batches_dp = batches[dp_mesh.mesh]
            assert all(not torch.equal(batches_dp[0], batches_dp[i]) for i in range(1, len(batches_dp)))

            return super().training_step(batch)

    strategy = S(
        data_parallel_size=2,
        tensor_parallel_size=2,
    )
    trainer = Trainer(
        accelerator="auto",
        devices=4,
        strategy=strategy,
        max_steps=2,
        enable_checkpointing=False,
        logger=False,
    )

    seed_everything(0)
    with trainer.init_module(empty_init=True):
        model = Model(compile=compile)

    trainer.fit(model)


def test_modules_without_parameters(S, tmp_path):
    """Test that TorchMetrics get moved to the device despite not having any parameters."""

    class MetricsModel(TensorParallelModel):
        def __init__(self):
            super().__init__()
            self.metric = Accuracy("multiclass", num_classes=10)
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def setup(self, stage) -> None:
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def training_step(self, batch):
            # Adapted: "cuda" -> "cpu" (the device the strategy moves the metric's states to here).
            assert self.metric.device.type == self.metric.tp.device.type == "cpu"
            self.metric(torch.rand(2, 10, device=self.device), torch.randint(0, 10, size=(2,), device=self.device))
            return super().training_step(batch)

    model = MetricsModel()
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=S(),
        max_steps=1,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(model)


def test_module_init_context(S, tmp_path, compile, precision, expected_dtype):
    """Test that the module under the init-context gets moved to the right device and dtype.

    Adapted: `torch.device("cuda", local_rank)` -> `torch.device("cpu")`, `.type == "cuda"` -> `"cpu"`; bf16-true,
    which Lightning runs only where CUDA has bf16, runs here (the CPU computes in bf16)."""
    expected_dtype = getattr(torch, expected_dtype)

    class Model(FSDP2Model):
        def on_train_start(self):
            assert self.model.w1.weight.device == torch.device("cpu")
            assert self.model.w1.weight.dtype == expected_dtype
            optimizer = self.optimizers(use_pl_optimizer=False)
            assert optimizer.param_groups[0]["params"][0].device.type == "cpu"

    def _run_setup_assertions(empty_init, expected_device):
        trainer = Trainer(
            default_root_dir=tmp_path,
            accelerator="cpu",
            devices=2,
            strategy=S(),
            precision=precision,
            max_steps=1,
            barebones=True,
            enable_checkpointing=False,
            logger=False,
        )
        with trainer.init_module(empty_init=empty_init):
            model = Model(compile=compile)

        # The model is on the CPU/meta-device until after `ModelParallelStrategy.setup()`
        assert model.model.w1.weight.device == expected_device
        assert model.model.w1.weight.dtype == expected_dtype
        trainer.fit(model)

    # Case 1: No empty init
    _run_setup_assertions(empty_init=False, expected_device=torch.device("cpu"))

    # Case 2: Empty-init with meta device
    _run_setup_assertions(empty_init=True, expected_device=torch.device("meta"))


def test_strategy_state_dict(S, tmp_path, save_distributed_checkpoint):
    """Test that the strategy returns the correct state dict of the LightningModule."""
    model = FSDP2Model()
    correct_state_dict = model.state_dict()  # State dict before wrapping

    strategy = S(save_distributed_checkpoint=save_distributed_checkpoint)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        barebones=True,
    )
    trainer.fit(model)

    state_dict = trainer.strategy.lightning_module_state_dict()

    if save_distributed_checkpoint:
        # All ranks return a state dict
        assert len(state_dict) > 0
        # State dict should contain same keys as non-distributed state dict
        assert list(state_dict.keys()) == list(correct_state_dict.keys())
    else:
        if trainer.global_rank != 0:
            # The full state-dict is only returned on rank 0
            assert len(state_dict) == 0
            return
        # State dict should contain same keys as non-distributed state dict
        assert list(state_dict.keys()) == list(correct_state_dict.keys())


def test_load_full_state_checkpoint_into_regular_model(S, tmp_path):
    """Test that a full-state checkpoint saved from a distributed model can be loaded back into a regular model."""

    # Save a regular full-state checkpoint from a distributed model
    model = FSDP2Model()
    strategy = S(save_distributed_checkpoint=False)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        barebones=True,
    )
    trainer.fit(model)
    model_path = tmp_path / "last.ckpt"
    model_path = trainer.strategy.broadcast(model_path)
    trainer.save_checkpoint(model_path)
    model_state_dict = trainer.strategy.lightning_module_state_dict()
    optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())

    if trainer.global_rank != 0:
        assert len(model_state_dict) == 0
        assert len(optimizer_state_dict) == 0

    # Create a regular model and load the checkpoint into it
    model = TemplateModel()
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy="ddp", max_epochs=1)
    trainer.fit(model, ckpt_path=model_path)
    _compare_restored(trainer, model, model_state_dict, optimizer_state_dict)


def _compare_restored(trainer, model, model_state_dict, optimizer_state_dict, only_rank_0=False):
    """The end both load tests share (Lightning's lines); ``only_rank_0``: the distributed model's full state is on
    rank 0 alone."""
    restored_model_state_dict = trainer.strategy.lightning_module_state_dict()
    restored_optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())

    if only_rank_0 and trainer.global_rank != 0:
        assert len(restored_model_state_dict) == 0
        assert len(restored_optimizer_state_dict) == 0
    if trainer.global_rank == 0:
        assert len(model_state_dict) == len(restored_model_state_dict)
        assert len(optimizer_state_dict) == len(restored_optimizer_state_dict)
        torch.testing.assert_close(model_state_dict, restored_model_state_dict, atol=0, rtol=0)
        torch.testing.assert_close(optimizer_state_dict, restored_optimizer_state_dict, atol=0, rtol=0)
    trainer.strategy.barrier()


def test_load_standard_checkpoint_into_distributed_model(S, tmp_path):
    """Test that a regular checkpoint (weights and optimizer states) can be loaded into a distributed model."""

    # Save a regular DDP checkpoint
    model = TemplateModel()
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy="ddp", max_epochs=1)
    trainer.fit(model)
    model_path = tmp_path / "last.ckpt"
    model_path = trainer.strategy.broadcast(model_path)
    trainer.save_checkpoint(model_path)
    model_state_dict = trainer.strategy.lightning_module_state_dict()
    optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())

    # Create a distributed model and load the checkpoint into it
    model = FSDP2Model()
    strategy = S(save_distributed_checkpoint=False)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        barebones=True,
    )
    trainer.fit(model, ckpt_path=model_path)
    _compare_restored(trainer, model, model_state_dict, optimizer_state_dict, only_rank_0=True)


def test_save_load_sharded_state_dict(S, tmp_path, own_states=()):
    """Test saving and loading with the distributed state dict format.

    ``own_states``: callback states the strategy itself adds to every checkpoint, left out of Lightning's count; see
    `save_load_sharded_state_dict_with_data_position`."""

    class CheckpointModel(FSDP2Model):
        def __init__(self, params_to_compare=None):
            super().__init__()
            self.params_to_compare = params_to_compare

        def on_train_start(self):
            if self.params_to_compare is None:
                return
            for p0, p1 in zip(self.params_to_compare, self.trainer.model.parameters()):
                assert torch.equal(p0, p1.full_tensor())

    seed_everything(0)

    strategy = S(save_distributed_checkpoint=True)
    trainer_kwargs = {
        "default_root_dir": tmp_path,
        "accelerator": "cpu",
        "devices": 2,
        "max_epochs": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
    }

    # Initial training
    model = CheckpointModel()
    trainer = Trainer(**trainer_kwargs, strategy=strategy)
    trainer.fit(model)
    params_before = [p.full_tensor() for p in trainer.model.parameters()]

    checkpoint_path = Path(trainer.strategy.broadcast(trainer.checkpoint_callback.best_model_path))
    assert set(os.listdir(checkpoint_path)) == {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"}

    metadata = torch.load(checkpoint_path / "meta.pt", weights_only=True)
    assert "pytorch-lightning_version" in metadata
    assert len(set(metadata["callbacks"]) - set(own_states)) == 1  # model checkpoint callback
    assert set(own_states) <= set(metadata["callbacks"])
    assert "state_dict" not in metadata
    assert "optimizer_states" not in metadata

    # Load checkpoint and continue training
    trainer_kwargs.update(max_epochs=2)
    model = CheckpointModel(params_to_compare=params_before)
    strategy = S(save_distributed_checkpoint=True)
    trainer = Trainer(**trainer_kwargs, strategy=strategy)
    trainer.fit(model, ckpt_path=checkpoint_path)


def save_load_sharded_state_dict_with_data_position(S, tmp_path):
    """A difference kept: DynaTrainStrategy adds its `BoundaryHook` callback to the trainer, whose state (the data
    split's position in the epoch, keyed by global sample) is in every checkpoint so that a resume on any world size,
    and a joining process, go on from the right sample; Lightning's case counts exactly one callback state (its
    ModelCheckpoint's). Lightning's case with that one state left out of the count: the rest of it (the DCP files,
    the metadata, resuming with equal parameters) kept."""
    test_save_load_sharded_state_dict(S, tmp_path, own_states=("BoundaryHook",))


# ---- which cases run on which world size ------------------------------------------------------------------------

def _cases() -> dict[int, dict[str, tuple]]:
    """Per world size: case id (Lightning's test id) -> (function, keyword arguments)."""
    init_context = {
        f"test_module_init_context[{compile}-{precision}-{dtype}]": (
            test_module_init_context, {"compile": compile, "precision": precision, "expected_dtype": dtype})
        for compile in (True, False)
        for precision, dtype in (("32-true", "float32"), ("16-true", "float16"), ("bf16-true", "bfloat16"))
    }
    return {
        1: {"test_model_parallel_single_file_checkpoint_with_compile":
            (test_model_parallel_single_file_checkpoint_with_compile, {})},
        2: {
            **{f"test_tensor_parallel[{c}]": (test_tensor_parallel, {"compile": c}) for c in (True, False)},
            "test_modules_without_parameters": (test_modules_without_parameters, {}),
            **init_context,
            **{f"test_strategy_state_dict[{s}]": (test_strategy_state_dict, {"save_distributed_checkpoint": s})
               for s in (True, False)},
            "test_load_full_state_checkpoint_into_regular_model": (
                test_load_full_state_checkpoint_into_regular_model, {}),
            "test_load_standard_checkpoint_into_distributed_model": (
                test_load_standard_checkpoint_into_distributed_model, {}),
            "test_save_load_sharded_state_dict": (test_save_load_sharded_state_dict, {}),
        },
        4: {
            "test_setup_device_mesh": (test_setup_device_mesh, {}),
            **{f"test_fsdp2_tensor_parallel[{c}]": (test_fsdp2_tensor_parallel, {"compile": c}) for c in (True, False)},
        },
    }


# DynaTrainStrategy only: the variant that holds where Lightning's case differs by design (see each docstring).
VARIANTS = {
    2: {**{f"tensor_parallel_lightning_defaults[{c}]": (tensor_parallel_lightning_defaults, {"compile": c})
           for c in (True, False)},
        "save_load_sharded_state_dict_with_data_position": (save_load_sharded_state_dict_with_data_position, {})},
    4: {"setup_device_mesh_dynatrain_names": (setup_device_mesh_dynatrain_names, {})},
}


def run_case(fn, kwargs, strategy_cls, tmp_path: Path) -> str | None:
    import torch.distributed as dist

    tmp_path.mkdir(parents=True, exist_ok=True)
    try:
        fn(strategy_cls, tmp_path, **kwargs)
        error = None
    except BaseException:  # noqa: BLE001 - the case's outcome, whatever it raised, is the result
        error = traceback.format_exc()
    if dist.is_initialized():
        dist.barrier()
    return error


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--only", default="", help="comma-separated case ids (default: all of this world size)")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)
    only = set(filter(None, args.only.split(",")))
    runs = [(name, case, "lightning") for name, case in _cases()[world].items()]
    runs += [(name, case, "dynatrain") for name, case in {**_cases()[world], **VARIANTS.get(world, {})}.items()]
    outcome = {}
    for name, (fn, kwargs), strategy in runs:
        if only and name not in only:
            continue
        directory = workdir / strategy / name.replace("[", "-").replace("]", "")
        outcome[f"{strategy}:{name}"] = run_case(fn, kwargs, STRATEGIES[strategy], directory)
    finish_rank(args.out, {"outcome": outcome})


if __name__ == "__main__":
    main()
