"""After a switch on NCCL, the process groups of the layouts left behind are destroyed (their communicators hold
device memory); a layout visited again is built and connected again. On a fake world of 4 ranks in one process."""

import torch

from dynatrain.vps.parallel_config import ParallelConfig


def test_a_switch_retires_the_groups_of_the_layouts_it_left():
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dynatrain
    from dynatrain.models.parallelize import mesh_groups

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        strategy = dynatrain.DynaTrainStrategy()
        strategy._device = torch.device("cpu")
        a, b, c = (ParallelConfig.parse(t) for t in ("dp_shard=4", "dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2"))
        for layout in (a, b, c):
            strategy.install_layout(strategy.build_mesh(layout), layout, range(4))
        assert strategy.retire_meshes() == 0  # a fake group is no NCCL one: meshes stay for reuse
        strategy.meshes.retire_groups = True
        left = {k[0]: [g for g in mesh_groups(m, k[0], min_size=1) if g is not dist.group.WORLD]
                for k, m in strategy.meshes.items()}
        retired = strategy.retire_meshes(keep=lambda layout: layout == b)  # b: a build kept for a request
        assert retired == len({id(g) for g in left[a]}) > 0
        assert not any(g in _world.pg_map for g in left[a])
        assert all(g in _world.pg_map for layout in (b, c) for g in left[layout])
        assert {k[0] for k in strategy.meshes} == {b, c}
        again = strategy.build_mesh(a)  # a layout visited again is built and connected again
        assert all(g in _world.pg_map for g in mesh_groups(again, a, min_size=1))
    finally:
        dist.destroy_process_group()
