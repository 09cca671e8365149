"""Lightning's own tests of `ModelParallelStrategy`, run against it and against `DynaTrainStrategy`, so that
Lightning compatibility is held by Lightning's expectations rather than by ours.

Source: Lightning-AI/pytorch-lightning at tag 2.6.5 (the newest 2.6 tag; 2.6.6 is installed and its
`ModelParallelStrategy` matches these tests, e.g. it still removes a sharded checkpoint with `shutil`):
`tests/tests_pytorch/strategies/test_model_parallel.py` (16 cases, below) and
`tests/tests_pytorch/strategies/test_model_parallel_integration.py` (18 cases, `tests/workers/lightning_mp.py`).
Every case runs with both strategies; its assertions are Lightning's. Adaptations common to all cases:
- `@RunIf(min_torch="2.4")` dropped: torch here is newer.
- the strategy: Lightning's `ModelParallelStrategy(...)` becomes `strategy_cls(...)` with the same arguments.

Each adaptation particular to one case is written beside it, here and in the worker. Where DynaTrainStrategy differs
from ModelParallelStrategy, the case says why: in the unit file inline (`test_configure_model_required`: a module
without configure_model() is parallelised by default), in the integration file in `DIFFERENCES` below (the mesh's
dimension names, the default layout, the strategy's own callback state in checkpoints), where the test asserts that
Lightning's case still fails on exactly that line with DynaTrainStrategy and that the worker's variant (Lightning's
case with only that assertion restated) holds, so a difference can neither grow nor vanish unnoticed.
"""

from __future__ import annotations

from datetime import timedelta
from re import escape
from unittest import mock
from unittest.mock import Mock

import pytest
import torch
import torch.nn as nn
from _launch import launch
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_3
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import ModelParallelStrategy

from dynatrain.strategies.dynatrain import DynaTrainStrategy

STRATEGIES = {"lightning": ModelParallelStrategy, "dynatrain": DynaTrainStrategy}


@pytest.fixture(params=list(STRATEGIES))
def strategy_cls(request):
    return STRATEGIES[request.param]


# ---- the unit file ------------------------------------------------------------------------------------------------

@mock.patch("lightning.pytorch.strategies.model_parallel._TORCH_GREATER_EQUAL_2_4", False)
def test_torch_greater_equal_2_4(strategy_cls):
    # Adapted: Lightning's message names the class of the strategy (`type(self).__name__`).
    with pytest.raises(ImportError, match=f"{strategy_cls.__name__} requires PyTorch 2.4 or higher"):
        strategy_cls()


def test_device_mesh_access(strategy_cls):
    strategy = strategy_cls()
    with pytest.raises(RuntimeError, match="Accessing the device mesh .* not allowed"):
        _ = strategy.device_mesh


@pytest.mark.parametrize(
    ("num_nodes", "devices", "invalid_dp_size", "invalid_tp_size"),
    [
        (1, 4, 1, 1),
        (1, 4, 2, 3),
        (1, 4, 4, 2),
        (2, 4, 1, 4),
        (2, 4, 2, 1),
    ],
)
def test_validate_device_mesh_dimensions(strategy_cls, num_nodes, devices, invalid_dp_size, invalid_tp_size):
    """Test passing sizes that don't multiply to the world size raises an error."""
    strategy = strategy_cls(
        data_parallel_size=invalid_dp_size,
        tensor_parallel_size=invalid_tp_size,
    )
    strategy._setup_distributed = Mock()
    strategy._accelerator = Mock()
    strategy.cluster_environment = Mock(
        world_size=Mock(return_value=(num_nodes * devices)), local_rank=Mock(return_value=1)
    )
    strategy.parallel_devices = [torch.device("cpu")] * devices
    strategy.num_nodes = num_nodes
    with pytest.raises(RuntimeError, match="multiplied should equal the world size"):
        strategy.setup_environment()


def test_fsdp_v1_modules_unsupported(strategy_cls):
    """Test that the strategy won't allow setting up a module wrapped with the legacy FSDP API."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    class Model(LightningModule):
        def configure_model(self):
            pass

    model = Model()
    model.modules = Mock(return_value=[Mock(spec=FullyShardedDataParallel)])
    strategy = strategy_cls()
    strategy.model = model
    strategy._lightning_module = model
    strategy._accelerator = Mock()

    with pytest.raises(TypeError, match="only supports the new FSDP2 APIs in PyTorch >= 2.4"):
        strategy.setup(Mock())


def test_configure_model_required(strategy_cls):
    class Model1(LightningModule):
        pass

    class Model2(LightningModule):
        def configure_model(self):
            pass

    model = Model1()
    strategy = strategy_cls()
    strategy.model = model
    strategy._lightning_module = model
    strategy._accelerator = Mock()
    strategy._parallel_devices = [torch.device("cpu")]

    if strategy_cls is ModelParallelStrategy:
        with pytest.raises(TypeError, match="you are required to override the `configure_model"):
            strategy.setup(Mock())
    else:
        # By design (issue 45 item 1): a module without configure_model() is parallelised by default (FSDP2 per
        # block), as Lightning's FSDPStrategy does; tests/test_auto_parallel.py and test_default_parallel_mp.py hold
        # that. Here set-up must only not refuse it the way Lightning does; its default parallelisation then needs
        # the mesh, which this mocked set-up never built.
        with pytest.raises(RuntimeError, match="Accessing the device mesh"):
            strategy.setup(Mock())

    model = Model2()
    strategy.model = model
    strategy._lightning_module = model
    strategy.setup(Mock())


def test_save_checkpoint_storage_options(strategy_cls, tmp_path):
    """Test that the strategy does not accept storage options for saving checkpoints."""
    strategy = strategy_cls()
    # Adapted: Lightning's message names the class of the strategy (`type(self).__name__`).
    with pytest.raises(
        TypeError, match=escape(f"{strategy_cls.__name__}.save_checkpoint(..., storage_options=...)` is not")
    ):
        strategy.save_checkpoint(checkpoint=Mock(), filepath=tmp_path, storage_options=Mock())


@mock.patch("lightning.fabric.plugins.io.torch_io._atomic_save")
@mock.patch("lightning.pytorch.strategies.model_parallel.shutil")
def test_save_checkpoint_path_exists(shutil_mock, torch_save_mock, strategy_cls, tmp_path):
    # Adapted: Lightning patches `ModelParallelStrategy.broadcast` to the identity; DynaTrainStrategy overrides
    # broadcast (and calls it with a source rank), so the class under test's own broadcast is the one patched.
    with mock.patch.object(strategy_cls, "broadcast", lambda _, x: x):
        _save_checkpoint_path_exists(shutil_mock, torch_save_mock, strategy_cls, tmp_path)


def _save_checkpoint_path_exists(shutil_mock, torch_save_mock, strategy_cls, tmp_path):
    strategy = strategy_cls(save_distributed_checkpoint=False)

    # save_distributed_checkpoint=False, path exists, path is not a sharded checkpoint: error
    path = tmp_path / "not-empty"
    path.mkdir()
    (path / "file").touch()
    assert not _is_sharded_checkpoint(path)
    with pytest.raises(IsADirectoryError, match="exists and is a directory"):
        strategy.save_checkpoint(Mock(), filepath=path)

    # save_distributed_checkpoint=False, path exists, path is a sharded checkpoint: no error (overwrite)
    path = tmp_path / "sharded-checkpoint"
    path.mkdir()
    (path / "meta.pt").touch()
    assert _is_sharded_checkpoint(path)
    strategy.save_checkpoint(Mock(), filepath=path)
    shutil_mock.rmtree.assert_called_once_with(path)

    # save_distributed_checkpoint=False, path exists, path is a file: no error (overwrite)
    path = tmp_path / "file.pt"
    path.touch()
    torch_save_mock.reset_mock()
    strategy.save_checkpoint(Mock(), filepath=path)
    torch_save_mock.assert_called_once()

    strategy = strategy_cls(save_distributed_checkpoint=True)

    save_mock = mock.patch("torch.distributed.checkpoint.save")

    # save_distributed_checkpoint=True, path exists, path is a folder: no error (overwrite)
    path = tmp_path / "not-empty-2"
    path.mkdir()
    (path / "file").touch()
    with save_mock:
        strategy.save_checkpoint({"state_dict": {}, "optimizer_states": {"": {}}}, filepath=path)
    assert (path / "file").exists()

    # save_distributed_checkpoint=True, path exists, path is a file: no error (overwrite)
    path = tmp_path / "file-2.pt"
    path.touch()
    with save_mock:
        strategy.save_checkpoint({"state_dict": {}, "optimizer_states": {"": {}}}, filepath=path)
    assert path.is_dir()


@mock.patch("lightning.fabric.strategies.model_parallel._has_dtensor_modules", return_value=True)
def test_load_unknown_checkpoint_type(_, strategy_cls, tmp_path):
    """Test that the strategy validates the contents at the checkpoint path."""
    strategy = strategy_cls()
    strategy.model = Mock()
    strategy._lightning_module = Mock(strict_loading=True)
    path = tmp_path / "empty_dir"  # neither a single file nor a directory with meta file
    path.mkdir()
    with pytest.raises(ValueError, match="does not point to a valid checkpoint"):
        strategy.load_checkpoint(checkpoint_path=path)


@mock.patch("torch.distributed.init_process_group")
def test_set_timeout(init_process_group_mock, strategy_cls):
    """Test that the timeout gets passed to the ``torch.distributed.init_process_group`` function."""
    # Adapted: Lightning mocks its mesh builder `model_parallel._setup_device_mesh`; DynaTrainStrategy builds its
    # (dp_replicate, dp_shard, tp) mesh with its own `build_mesh` instead, which is mocked for it (either would need
    # the real process group the mocked init_process_group never made).
    mesh_builder = (mock.patch("lightning.pytorch.strategies.model_parallel._setup_device_mesh")
                    if strategy_cls is ModelParallelStrategy else mock.patch.object(strategy_cls, "build_mesh"))
    with mesh_builder:
        test_timedelta = timedelta(seconds=30)
        strategy = strategy_cls(timeout=test_timedelta)
        # Adapted for DynaTrainStrategy: its setup_environment checks the layout against the model the module holds
        # (a zoo model's heads must divide by tp), and a Mock cannot list its modules: an empty LightningModule.
        strategy._lightning_module = Mock() if strategy_cls is ModelParallelStrategy else LightningModule()
        strategy.parallel_devices = [torch.device("cpu")]
        strategy.cluster_environment = LightningEnvironment()
        strategy.accelerator = Mock()
        strategy.setup_environment()
        process_group_backend = strategy._get_process_group_backend()
        global_rank = strategy.cluster_environment.global_rank()
        world_size = strategy.cluster_environment.world_size()
        kwargs = {}
        if _TORCH_GREATER_EQUAL_2_3:
            kwargs["device_id"] = strategy.root_device if strategy.root_device.type != "cpu" else None
        init_process_group_mock.assert_called_with(
            process_group_backend, rank=global_rank, world_size=world_size, timeout=test_timedelta, **kwargs
        )


def test_meta_device_materialization(strategy_cls):
    """Test that the `setup()` method materializes meta-device tensors in the LightningModule."""

    class NoResetParameters(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4, 4))

    class CustomModel(LightningModule):
        def __init__(self):
            super().__init__()
            # nn.Sequential as a parameterless module
            self.layer1 = nn.Sequential(NoResetParameters(), NoResetParameters())
            self.layer2 = nn.Linear(4, 4)
            self.register_buffer("buffer", torch.rand(2))

        def reset_parameters(self):
            self.buffer.fill_(1.0)

        def configure_model(self) -> None:
            pass

    with torch.device("meta"):
        model = CustomModel()
    assert model.layer1[0].weight.is_meta
    assert model.layer2.weight.is_meta
    assert model.buffer.is_meta

    strategy = strategy_cls()
    strategy._accelerator = Mock()
    strategy._device_mesh = Mock()
    strategy._parallel_devices = [torch.device("cpu")]
    strategy._lightning_module = model
    strategy.model = model

    with pytest.warns(UserWarning, match=r"`reset_parameters\(\)` method for re-initialization: NoResetParameters"):
        strategy.setup(Mock())
    assert all(not p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())


# The last two tests of the unit file call Lightning's `_align_compiled_param_names_with_module` alone, without a
# strategy: they run once. They hold for DynaTrainStrategy as well because its load_checkpoint ends in
# ModelParallelStrategy's for every checkpoint that is not a dynatrain snapshot, and that is where the function is
# applied (`test_load_ends_in_lightnings_load_for_a_lightning_checkpoint` holds the path).

def test_align_compiled_param_names_with_module():
    """Test that optimizer state dict keys are aligned with compiled submodule parameter names."""
    from lightning.pytorch.strategies.model_parallel import _align_compiled_param_names_with_module

    class SimpleModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

        def forward(self, x):
            return self.model(x)

    # Test with compiled submodule
    m = SimpleModule()
    m.model = torch.compile(m.model)

    # Simulate optimizer state dict without _orig_mod in keys (includes both state and param_groups)
    state_dict = {
        "state": {
            "model.0.weight": {"step": 1},
            "model.0.bias": {"step": 1},
            "model.2.weight": {"step": 1},
            "model.2.bias": {"step": 1},
        },
        "param_groups": [{"params": ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"], "lr": 0.01}],
    }

    result = _align_compiled_param_names_with_module(state_dict, m)

    # Verify state keys now have _orig_mod inserted
    expected_keys = {
        "model._orig_mod.0.weight",
        "model._orig_mod.0.bias",
        "model._orig_mod.2.weight",
        "model._orig_mod.2.bias",
    }
    assert set(result["state"].keys()) == expected_keys

    # Verify param_groups params also have _orig_mod inserted
    assert set(result["param_groups"][0]["params"]) == expected_keys

    # Verify they match the module's named_parameters
    param_names = {name for name, _ in m.named_parameters()}
    assert set(result["state"].keys()) == param_names


def test_align_compiled_param_names_no_compile():
    """Test that non-compiled modules pass through unchanged."""
    from lightning.pytorch.strategies.model_parallel import _align_compiled_param_names_with_module

    class SimpleModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))

        def forward(self, x):
            return self.model(x)

    m = SimpleModule()  # Not compiled

    state_dict = {
        "state": {
            "model.0.weight": {"step": 1},
            "model.0.bias": {"step": 1},
        }
    }

    result = _align_compiled_param_names_with_module(state_dict, m)

    # Keys should be unchanged
    assert set(result["state"].keys()) == {"model.0.weight", "model.0.bias"}


def test_load_ends_in_lightnings_load_for_a_lightning_checkpoint(tmp_path):
    """Ours, not Lightning's: the premise under which the two tests above hold for DynaTrainStrategy."""
    path = tmp_path / "empty_dir"
    path.mkdir()
    strategy = DynaTrainStrategy()
    with mock.patch.object(ModelParallelStrategy, "load_checkpoint", return_value={"from": "lightning"}) as load:
        assert strategy.load_checkpoint(path) == {"from": "lightning"}
    load.assert_called_once_with(path, weights_only=None)


# ---- the integration file (tests/workers/lightning_mp.py) --------------------------------------------------------

# Lightning's integration cases where DynaTrainStrategy differs from ModelParallelStrategy, with the source line each
# must still fail on (the difference is this one and no other) and the variant of ours that holds instead. The
# reasons are in the variants' docstrings in the worker.
DIFFERENCES = {
    # by design: the mesh is (dp_replicate, dp_shard, tp); "data_parallel" / "tensor_parallel" index it as in Lightning
    "test_setup_device_mesh": ("assert device_mesh.mesh_dim_names == names", "setup_device_mesh_dynatrain_names"),
    # by design: DynaTrainStrategy() is pure FSDP, ModelParallelStrategy() tp over a node's devices
    "test_tensor_parallel[True]": ("assert len(dataloader) == 8 // dataloader.batch_size",
                                   "tensor_parallel_lightning_defaults[True]"),
    "test_tensor_parallel[False]": ("assert len(dataloader) == 8 // dataloader.batch_size",
                                    "tensor_parallel_lightning_defaults[False]"),
    # kept: the strategy's own callback state (the data's position) is in every checkpoint
    "test_save_load_sharded_state_dict": ("assert len(set(metadata[\"callbacks\"]) - set(own_states)) == 1",
                                          "save_load_sharded_state_dict_with_data_position"),
}


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_lightnings_integration_cases_hold_for_both_strategies(world, tmp_path):
    """One launch per world size runs every case of that size with ModelParallelStrategy, then DynaTrainStrategy."""
    ranks = launch("lightning_mp.py", world, ["--workdir", str(tmp_path / "work")], tmp_path / "launch", timeout=360)
    outcome = {name: [rank["outcome"][name] for rank in ranks] for name in ranks[0]["outcome"]}
    failed = {name: next(filter(None, errors)) for name, errors in outcome.items() if any(errors)}
    lightning = [name.split(":", 1)[1] for name in outcome if name.startswith("lightning:")]
    assert lightning, "no case ran"
    expected_failures = {f"dynatrain:{case}" for case in lightning if case in DIFFERENCES}
    unexpected = {name: error for name, error in failed.items() if name not in expected_failures}
    assert not unexpected, "\n\n".join(f"{name}:\n{error}" for name, error in unexpected.items())
    for case in (c for c in lightning if c in DIFFERENCES):
        line, variant = DIFFERENCES[case]
        error = failed.get(f"dynatrain:{case}")
        assert error is not None, f"{case} now holds for DynaTrainStrategy: drop it from DIFFERENCES"
        # On every rank, on the line that states the difference (AssertionError tracebacks quote their line).
        assert all(line in e.splitlines()[-3] for e in outcome[f"dynatrain:{case}"]), error
        assert outcome[f"dynatrain:{variant}"] == [None] * world
