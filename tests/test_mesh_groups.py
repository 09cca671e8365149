"""A new mesh's groups are connected when the mesh is built, not by the first training step's collectives."""

import warnings

import pytest

import torch

from dynatrain.models.parallelize import connect_mesh_groups, init_mesh
from dynatrain.vps.parallel_config import ParallelConfig


class _Sub:
    def __init__(self, size, group):
        self._size, self._group = size, group

    def size(self):
        return self._size

    def get_group(self):
        return self._group


class _Mesh:
    """Answers each name with a sub-mesh of the given size; names listed in ``shared`` return one group object."""

    def __init__(self, sizes, shared=()):
        self.sizes = sizes
        common = object()
        self.groups = {name: common if name in shared else object() for name in sizes}

    def __getitem__(self, name):
        return _Sub(self.sizes[name], self.groups[name])


def test_every_group_with_peers_takes_one_collective_in_mesh_order(monkeypatch):
    pcfg = ParallelConfig.parse("dp_replicate=2,dp_shard=2,tp=2")
    names = (*pcfg.mesh_dim_names, *pcfg.flattened_dims())
    # tensor_parallel is tp itself: the same group must not take a second collective.
    mesh = _Mesh({n: 2 if n != "data_parallel" else 4 for n in names}, shared=("tp", "tensor_parallel"))
    seen = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, group=None: seen.append((group, t.numel(), t.device.type)))
    assert connect_mesh_groups(mesh, pcfg, torch.device("cpu")) == 4
    expected = [mesh.groups[n] for n in ("dp_replicate", "dp_shard", "tp", "data_parallel")]
    assert [g for g, _, _ in seen] == expected
    assert all(n == 1 and dev == "cpu" for _, n, dev in seen)


def test_single_rank_dimensions_take_no_collective(monkeypatch):
    pcfg = ParallelConfig.parse("dp_shard=4")
    names = (*pcfg.mesh_dim_names, *pcfg.flattened_dims())
    mesh = _Mesh({n: 4 if n in ("dp_shard", "data_parallel") else 1 for n in names})
    seen = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group=None: seen.append(group))
    assert connect_mesh_groups(mesh, pcfg, "cpu") == 2
    assert seen == [mesh.groups["dp_shard"], mesh.groups["data_parallel"]]


def test_the_strategy_connects_a_mesh_once_when_it_builds_it(monkeypatch):
    import dynatrain.strategies.mesh_cache as mesh_cache_mod

    built, connected = [], []
    monkeypatch.setattr(mesh_cache_mod, "init_mesh", lambda pcfg, kind, ranks: built.append(ranks) or object())
    monkeypatch.setattr(mesh_cache_mod, "connect_mesh_groups", lambda mesh, pcfg, device: connected.append(mesh))
    meshes, cpu = mesh_cache_mod.MeshCache(), torch.device("cpu")
    pcfg = ParallelConfig.parse("dp_shard=2,tp=2")
    first = meshes.get(pcfg, cpu)
    again = meshes.get(pcfg, cpu)  # a switch back to a layout it has seen
    other = meshes.get(pcfg, cpu, ranks=[0, 2, 1, 3])
    assert first is again and other is not first
    assert connected == [first, other]


def test_a_real_mesh_reads_its_flattened_names_without_the_deprecated_slice(one_process_group):
    pcfg = ParallelConfig.parse("dp_shard=1")
    mesh = init_mesh(pcfg, "cpu")
    with warnings.catch_warnings():
        # torch warns when a flattened name is sliced from the root mesh, a use it means to remove.
        warnings.filterwarnings("error", message="Slicing a flattened dim")
        assert connect_mesh_groups(mesh, pcfg, "cpu") == 0



def test_a_layouts_groups_follow_its_rank_arrangement_along_every_dimension_and_flattened_name():
    from dynatrain.models.mesh_groups import layout_groups, rank_groups

    pcfg = ParallelConfig.parse("dp_shard=2,tp=2")
    assert rank_groups(pcfg, [0, 1, 2, 3], 1) == {
        "dp_replicate": (1,), "dp_shard": (1, 3), "tp": (0, 1), "data_parallel": (1, 3), "tensor_parallel": (0, 1)}
    # Another arrangement (ascending along each dimension): the groups follow the positions, not the rank numbers.
    moved = rank_groups(pcfg, [0, 2, 1, 3], 1)
    assert moved["dp_shard"] == (0, 1) and moved["tp"] == (1, 3)
    assert layout_groups(pcfg, [0, 1, 2, 3]) == [(0,), (0, 1), (0, 2), (1,), (1, 3), (2,), (2, 3), (3,)]
    with_cp = rank_groups(ParallelConfig.parse("dp_shard=2,cp=2"), [0, 1, 2, 3], 2)
    assert with_cp["dp_shard_cp"] == (0, 1, 2, 3) and with_cp["cp"] == (2, 3) and with_cp["dp_shard"] == (0, 2)
    with pytest.raises(ValueError, match="rank 7 is not in the mesh"):
        rank_groups(pcfg, [0, 1, 2, 3], 7)
