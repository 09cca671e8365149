"""The NCCL rules (tests/nccl_rules.py) refuse what NCCL would, and the code passes them.

Every multi-process test of the suite runs under the rules (tests/conftest.py puts each process a test starts
under them and fails a test whose processes broke one); this file shows that they bite: the agreement sent on a
training group (what the elastic callback did before the control group), a group whose first operation is
point-to-point, training traffic on the control group, a tensor of another device type than its group takes, and
sends posted in another order than their receives."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nccl_rules

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _run_cases(tmp_path: Path) -> tuple[list[dict], Path]:
    rules = tmp_path / "rules"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS / "nccl_site"), str(REPO)]),
               OMP_NUM_THREADS="1", **{nccl_rules.ENV: str(rules)})
    proc = subprocess.run([sys.executable, str(TESTS / "workers" / "nccl_rules_cases.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    return rows, rules


def test_the_rules_refuse_what_nccl_would_and_pass_the_control_group(tmp_path):
    rows, rules = _run_cases(tmp_path)
    for row in rows:
        assert row["agreement_on_training_group"].startswith("refused"), row
        assert "metadata belongs on the control group" in row["agreement_on_training_group"]
        assert row["agreement_on_control_group"] == "passed", row
        assert "from outside dynatrain.runtime.control_group" in row["training_traffic_on_control_group"], row
        assert "with a tensor on meta: this group takes cpu tensors only" in row["wrong_device_on_training_group"]
        assert "first operation on the fresh group" in row["p2p_first_on_fresh_group"], row
        # Each rank alone sees nothing wrong in its own order: the pairs are compared afterwards.
        assert row["p2p_after_a_collective_out_of_order"] == "passed", row
    assert len(nccl_rules.violations(rules)) == 8  # four refusals on each of two ranks, written as they happened
    problems = nccl_rules.check_pairs(rules)
    assert len(problems) == 1 and "rank 0's send #0 to rank 1" in problems[0], problems
    assert "float32" in problems[0] and "int64" in problems[0]


def test_this_suite_runs_under_the_rules():
    assert nccl_rules.installed()
    assert os.environ[nccl_rules.ENV]
    assert str(TESTS / "nccl_site") in os.environ["PYTHONPATH"].split(os.pathsep)


# Modules that call torch.distributed's collectives themselves, and why their tensors are device tensors (or their
# group a gloo one of their own). Metadata goes through dynatrain/runtime/control_group.py; a new call site elsewhere must be
# added here with its reason, which is the review this list forces.
DEVICE_TRAFFIC = {
    "dynatrain/runtime/control_group.py": "the control channel itself: CPU tensors on the control group",
    "dynatrain/engine/transition.py": "the switch's bytes: the states' own tensors, on their device",
    "dynatrain/models/expert_parallel.py": "token counts and tokens of the experts, on the activations' device",
    "dynatrain/models/context_parallel.py": "a router's token counts summed over the cp group, on their device",
    "dynatrain/models/parallelize.py": "one device element per mesh group, to connect it before the first step",
    "dynatrain/strategies/pipeline_runner.py": "the last stage's loss, on the device",
    "dynatrain/elastic/next_world.py": "one device element on a new world's default group: its first operation",
    "dynatrain/lm/causal_lm.py": "the step's losses and router counts, on the device",
    "dynatrain/callbacks/snapshot.py": "commit flags on the root device; DCP on a gloo group of its own",
    "dynatrain/callbacks/reference.py": "a barrier on a gloo group of its own",
    "dynatrain/elastic/world.py": "a world's barrier before it is destroyed",
    "dynatrain/launch/local.py": "a rank's last barrier",
    "dynatrain/selfcheck/worker.py": "the step's loss, on the device",
    "dynatrain/selfcheck/oracle.py": "the comparison's flag, on the device",
}
OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"}


def _collective_calls():
    import ast

    ops = nccl_rules._COLLECTIVES | nccl_rules._P2P
    for path in sorted((REPO / "dynatrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ops:
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id == "dist" or \
                        isinstance(owner, ast.Attribute) and owner.attr == "distributed":
                    yield path.relative_to(REPO).as_posix(), node.lineno, node.func.attr


def test_collectives_outside_the_control_channel_carry_device_tensors_only():
    calls = list(_collective_calls())
    assert calls, "the scan found no collective at all: it no longer reads the sources"
    unlisted = [f"{p}:{line} dist.{op}" for p, line, op in calls if p not in DEVICE_TRAFFIC]
    assert not unlisted, ("metadata collectives must go through dynatrain.runtime.control_group (a gloo group beside NCCL); "
                          f"or list the module in DEVICE_TRAFFIC with why its tensors are device tensors: {unlisted}")
    objects = [f"{p}:{line} dist.{op}" for p, line, op in calls if op in OBJECT_COLLECTIVES and
               p != "dynatrain/runtime/control_group.py"]
    assert not objects, ("object collectives stage through the CUDA device on NCCL; use control.all_gather_object: "
                         f"{objects}")
    stale = sorted(set(DEVICE_TRAFFIC) - {p for p, _, _ in calls})
    assert not stale, f"listed modules that no longer call a collective: {stale}"
