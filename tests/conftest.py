"""Fixtures shared by the test files, and the NCCL rules (tests/nccl_rules.py) over every test's processes."""

import os
import tempfile
from pathlib import Path

import pytest

import nccl_rules

# Every process a test starts runs under the rules (tests/nccl_site/sitecustomize.py reads these), and so does this
# one; a test whose processes broke one fails (`nccl_rules_hold`).
_RULES = Path(tempfile.mkdtemp(prefix="dynatrain-nccl-rules-"))
os.environ[nccl_rules.ENV] = str(_RULES)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(Path(__file__).parent / "nccl_site"), os.environ.get("PYTHONPATH")) if p)
nccl_rules.install()


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    """A gloo world of one process: what building a model on a probe mesh of fake groups needs."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# Modules whose tests share a module-scoped reference run (a multi-process launch of 10 to 60 s): one pytest worker
# takes the whole module, so the reference runs once. Every other test is a unit of its own. (xdist's `xdist_group`
# mark cannot do this on pytest 9: it renames `item._nodeid`, which pytest 9 no longer reads.)
ONE_WORKER_MODULES = {"test_checkpointing_compile_mp.py", "test_data_streams_mp.py", "test_elastic_mp.py",
                      "test_moe_switch.py", "test_pipeline_mp.py", "test_torchrun_backend.py", "test_training_mp.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModulesWithAReference(LoadScopeScheduling):
        # The method xdist's own loadfile and loadgroup schedulers override; pyproject.toml keeps xdist below 4.
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.rsplit("/", 1)[-1] in ONE_WORKER_MODULES else nodeid

    return ModulesWithAReference(config, log)


@pytest.fixture(scope="session", autouse=True)
def _nccl_rules_dir():
    yield
    import shutil

    shutil.rmtree(_RULES, ignore_errors=True)


@pytest.fixture(autouse=True)
def nccl_rules_hold():
    """Fail a test whose processes broke an NCCL rule, even one whose error was caught on the way."""
    start = nccl_rules.offsets(_RULES)
    yield
    problems = nccl_rules.violations(_RULES, start) + nccl_rules.check_pairs(_RULES, start)
    if problems:
        pytest.fail("NCCL rules broken (tests/nccl_rules.py):\n" + "\n".join(problems[:20]), pytrace=False)
