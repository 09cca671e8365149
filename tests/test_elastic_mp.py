"""Processes leave and join a running Lightning job; every switch bitwise-verified, losses as a static run."""

import pytest

from tests._launch import launch, launch_elastic

pytestmark = pytest.mark.multiprocess

SWITCHES = "2:dp_shard=2:2,3;4:dp_shard=3;6:dp_shard=2,tp=2"


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.timeout(420)
def test_scale_in_then_out_with_joining_processes(tmp_path):
    steps = 8
    static = launch("elastic.py", 4, ["--layout", "dp_shard=4", "--steps", str(steps), "--static"], tmp_path / "s")
    members, joiners = launch_elastic(
        "elastic.py", 4, ["--layout", "dp_shard=4", "--steps", str(steps), "--switches", SWITCHES],
        tmp_path / "e", joiners=[["--first", "2"], ["--first", "3"]], timeout=360,
    )
    # Ranks 2 and 3 left at the first switch, with status 0, after sending their shards.
    for m in members[2:]:
        assert m["left"] and m["global_step"] <= 4, m
    for p in members[:2] + joiners:
        assert not p["left"]
        assert p["layout"] == "dp_shard=2,tp=2" and p["world_size"] == 4 and p["global_step"] == steps, p
    assert sorted(p["global_rank"] for p in members[:2] + joiners) == [0, 1, 2, 3]
    # Every switch each process took part in was checked bitwise against the state before it.
    first = members[0]
    assert [r["new_layout"] for r in first["reports"]] == ["dp_shard=2", "dp_shard=3", "dp_shard=2,tp=2"]
    assert [r["world_size"] for r in first["reports"]] == [2, 3, 4]
    assert all(r["verified"] for p in members[:2] + joiners for r in p["reports"])
    # Same global batch, same data, same optimizer state: the losses of a static run, step for step.
    ref = static[0]["losses"]
    assert len(first["losses"]) == len(ref) == steps
    assert all(_close(a, b) for a, b in zip(first["losses"], ref)), (first["losses"], ref)
    # A joiner continues the same step count and loss curve.
    assert joiners[1]["losses"] and _close(joiners[1]["losses"][-1], ref[-1])
