"""Fixtures shared by the test files."""

import pytest


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    """A gloo world of one process: what building a model on a probe mesh of fake groups needs."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
