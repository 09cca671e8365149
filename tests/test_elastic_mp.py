"""Processes leave and join a running Lightning job; every switch bitwise-verified, losses as a static run."""

import pytest

from dynatrain.runtime.threads import share
from tests._launch import launch, launch_elastic

pytestmark = pytest.mark.multiprocess

# Every switch planned ahead: a scale-out then switches once the world it forms with its admitted joiners has formed
# (the boundary after their admission at the latest), so the requests come early enough for the last joiner to train
# a step.
SWITCHES = "2:dp_shard=2:2,3:ahead;3:dp_shard=3::ahead;4:dp_shard=2,tp=2::ahead"


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


STEPS = 8


@pytest.fixture(scope="module")
def static_losses(tmp_path_factory):
    """The reference: the same global batch and data on a fixed dp_shard=4 world."""
    static = launch("elastic.py", 4, ["--layout", "dp_shard=4", "--steps", str(STEPS), "--static"],
                    tmp_path_factory.mktemp("static"))
    return static[0]["losses"]


@pytest.mark.timeout(420)
def test_scale_in_then_out_with_joining_processes(tmp_path, static_losses, monkeypatch):
    steps = STEPS
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the launcher chooses every process's threads
    # The second joiner starts only once the members requested dp_shard=2,tp=2. From step 4 on, a pending scale-out
    # holds training until a joiner is ready: admitted, it forms the next world with the members while they train
    # the next step, and they switch after it.
    signal = str(tmp_path / "preparing")
    # The scale-in is planned ahead: requested at the first micro-batch of step 2, it runs at the end of that
    # optimizer step.
    members, joiners = launch_elastic(
        "elastic.py", 4, ["--layout", "dp_shard=4", "--steps", str(steps), "--switches", SWITCHES,
                          "--prepared-signal", f"dp_shard=2,tp=2@{signal}", "--hold-for-joiner", "4"],
        tmp_path / "e", joiners=[[], ["--start-after", signal]], timeout=360, threads=None,
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
    # Forming a world and a mesh's groups are phases of their own beside the engine's transfer; the wait at the
    # boundary for the slowest rank's step is kept apart from the stall.
    for r in first["reports"]:
        assert {"plan", "world", "mesh", "build", "transfer", "adopt"} <= set(r["phases"]), r["phases"]
        assert r["boundary_wait_s"] >= 0 and r["stall_s"] == pytest.approx(sum(r["phases"].values()))
    # Each ran from a plan prepared while the members trained on.
    assert [r["prepared"] for r in first["reports"]] == [True, True, True]
    # Every one of the three knew its members ahead (the scale-in its leavers, each scale-out its ready joiners), so
    # its target world formed while at least one optimizer step trained, and the stall only swapped it in.
    assert all(r["formed_ahead_steps"] >= 1 for r in first["reports"]), [r["formed_ahead_steps"] for r in
                                                                        first["reports"]]
    assert all(m["reports"][0]["prepared"] for m in members[2:]), "the leavers sent from the prepared plan too"
    # Same global batch, same data, same optimizer state: the losses of a static run, step for step.
    ref = static_losses
    assert len(first["losses"]) == len(ref) == steps
    assert all(_close(a, b) for a, b in zip(first["losses"], ref)), (first["losses"], ref)
    # A joiner continues the same step count and loss curve.
    assert joiners[1]["losses"] and _close(joiners[1]["losses"][-1], ref[-1])
    # The launcher chose every process's threads, so each took its share of the cores in every world it entered
    # (the joiners started with their share among 6): 4, 2, 3 and 4 processes on this host.
    for p in members[:2] + joiners:
        assert (p["threads_env"], p["processes_on_host"], p["threads"]) == ("split", 4, share(4)), p
    assert members[0]["thread_splits"] == [[n, share(n)] for n in (4, 2, 3, 4)]
    assert [j["thread_splits"] for j in joiners] == [[[n, share(n)] for n in (3, 4)], [[4, share(4)]]]


@pytest.mark.timeout(300)
def test_a_process_killed_mid_step_is_recovered_from_replicas(tmp_path, static_losses):
    """HSDP keeps every shard on two processes: when one dies inside a step, the survivors re-form the world,
    rebuild the state from the replicas and run that step again; the loss curve is the uninterrupted one."""
    members, _ = launch_elastic("elastic.py", 4, ["--layout", "dp_replicate=2,dp_shard=2", "--steps", str(STEPS),
                                                  "--crash", "3:3", "--timeout", "30"],
                                tmp_path, may_die=[3], grace=120, timeout=280)
    assert members[3] is None
    for m in members[:3]:
        assert m["world_size"] == 3 and m["layout"] == "dp_shard=3" and m["global_step"] == STEPS, m
        [rec] = m["recoveries"]
        assert rec["step"] == 3 and rec["lost"] == ["000000-000003"] and rec["new_layout"] == "dp_shard=3", rec
        assert rec["seconds"] < 60, rec  # bounded by the process-group timeout, not a hang
        # every shard of rank 3's twin rank 1 had no other holder; ranks 0 and 2 compared theirs before using them
        assert rec["replicas_compared"] > 0, rec
    assert sorted(m["global_rank"] for m in members[:3]) == [0, 1, 2]
    losses = members[0]["losses"]
    assert len(losses) == STEPS and all(_close(a, b) for a, b in zip(losses, static_losses)), (losses, static_losses)


@pytest.mark.timeout(300)
def test_survivors_whose_replicas_differ_stop_instead_of_training_on_either(tmp_path):
    """Rank 2's copy of a state that rank 0 also holds ran an update rank 0's did not (a test double of work a GPU
    queued behind the collective that failed): the survivors compare before recovering, and every one of them stops
    with the states named, so the job resumes from its snapshot."""
    with pytest.raises(AssertionError) as err:
        launch_elastic("elastic.py", 4, ["--layout", "dp_replicate=2,dp_shard=2", "--steps", str(STEPS),
                                         "--crash", "3:3", "--diverge", "3:2", "--timeout", "30"],
                       tmp_path, may_die=[3], grace=120, timeout=280)
    text = str(err.value)
    assert "ranks [0, 1, 2] failed" in text and "cannot be rebuilt in memory" in text, text[-3000:]
    assert "copies of 1 state(s) differ" in text and ".exp_avg: box" in text and "[0] / [2]" in text, text[-3000:]
    assert "resume from the latest snapshot" in text, text[-3000:]


@pytest.mark.timeout(200)
def test_a_process_killed_without_a_replica_stops_the_job_with_a_clear_error(tmp_path):
    import time

    start = time.monotonic()
    with pytest.raises(AssertionError) as err:
        launch_elastic("elastic.py", 2, ["--layout", "dp_shard=2", "--steps", "5", "--crash", "2:1", "--timeout", "20"],
                       tmp_path, may_die=[1], grace=90, timeout=150)
    text = str(err.value)
    assert "ranks [0] failed" in text and "cannot be rebuilt in memory" in text, text[-3000:]
    assert "held only by lost processes" in text and "resume from the latest snapshot" in text, text[-3000:]
    assert time.monotonic() - start < 120


@pytest.mark.timeout(300)
def test_rank_zero_leaves_and_hands_over_logging(tmp_path, static_losses):
    steps = STEPS
    args = ["--layout", "dp_shard=3", "--steps", str(steps)]
    members, _ = launch_elastic("elastic.py", 3, [*args, "--switches", "2:dp_shard=2:0", "--log-dir",
                                                  str(tmp_path / "logs")], tmp_path / "e")
    assert members[0]["left"] and not members[1]["left"] and not members[2]["left"]
    assert [members[1]["global_rank"], members[2]["global_rank"]] == [0, 1]
    assert all(m["world_size"] == 2 and m["layout"] == "dp_shard=2" for m in members[1:])
    assert len(members[1]["losses"]) == steps
    assert all(_close(a, b) for a, b in zip(members[1]["losses"], static_losses))
    # The new rank 0 writes into the run directory the old rank 0 chose, and goes on where it stopped.
    assert members[0]["log_dir"] == members[1]["log_dir"] == members[2]["log_dir"]
    import csv
    from pathlib import Path

    rows = list(csv.DictReader(open(Path(members[1]["log_dir"]) / "metrics.csv")))
    steps_logged = sorted({int(r["step"]) for r in rows if r.get("train/loss")})
    assert steps_logged[0] <= 1 and steps_logged[-1] == steps - 1, steps_logged


@pytest.mark.timeout(300)
def test_a_leaver_killed_before_the_switch_stops_the_job_with_a_clear_error(tmp_path):
    import time

    start = time.monotonic()
    with pytest.raises(AssertionError) as err:
        launch_elastic("elastic.py", 4, ["--layout", "dp_shard=4", "--steps", "6", "--switches", "2:dp_shard=2:2,3",
                                         "--die", "2:3", "--timeout", "20"], tmp_path, grace=120)
    text = str(err.value)
    assert "did not take part within the 20s elastic timeout" in text, text[-3000:]
    assert time.monotonic() - start < 200


@pytest.mark.timeout(300)
def test_a_preempted_process_leaves_before_it_dies(tmp_path):
    steps = 6
    members, _ = launch_elastic("elastic.py", 3, ["--layout", "dp_shard=3", "--steps", str(steps),
                                                  "--preempt", "2:1"], tmp_path)
    # Rank 1 got SIGTERM: the ElasticCallback's agreement carried it to every rank, the planner picked the
    # layout for the 2 devices left, and rank 1 sent its shards and left with status 0.
    assert members[1]["left"] and not members[0]["left"] and not members[2]["left"]
    for m in (members[0], members[2]):
        assert m["world_size"] == 2 and m["global_step"] == steps
        assert [r["new_layout"] for r in m["reports"]] == ["dp_shard=2"] and m["reports"][0]["verified"]


@pytest.mark.timeout(300)
def test_a_byte_a_joiner_received_flipped_is_named_by_every_process(tmp_path):
    """Where every member stays, the sums of before are not reduced on the old world: the members' sums and what
    every process received meet in the check's one all-reduce on the new world, so a flipped byte is still named."""
    members, joiners = launch_elastic("elastic.py", 2, ["--layout", "dp_shard=2", "--steps", "4", "--switches",
                                                        "2:dp_shard=3", "--hold-for-joiner", "2"],
                                      tmp_path, joiners=[["--corrupt-received"]], timeout=240)
    errors = {p["check_error"] for p in members + joiners}
    assert len(errors) == 1, errors  # the same verdict on every process
    error = errors.pop()
    assert "dp_shard=2 -> dp_shard=3 changed 1 state(s)" in error and "wq.weight: values differ" in error, error


@pytest.mark.timeout(300)
def test_a_switch_within_the_world_after_a_joiner_came_builds_alike_on_members_and_joiner(tmp_path):
    # The members built tp=2 in the first world; the joiner never did. At the last request every rank must take the
    # same branch (a build on the real mesh creates groups, and the arrangement's weights are agreed collectively).
    # The scale-out holds training at step 3 until the joiner is ready, however long it takes to start.
    switches = "1:tp=2;2:dp_shard=1:1;3:dp_shard=2;4:tp=2"
    members, joiners = launch_elastic("elastic.py", 2, ["--layout", "dp_shard=2", "--steps", "6", "--switches",
                                                        switches, "--timeout", "30", "--hold-for-joiner", "3"],
                                      tmp_path, joiners=[[]], timeout=240)
    assert members[1]["left"] and not members[0]["left"]
    for p in (members[0], joiners[0]):
        assert p["layout"] == "tp=2" and p["world_size"] == 2 and p["global_step"] == 6, p
        assert all(r["verified"] for r in p["reports"])
    assert [r["new_layout"] for r in members[0]["reports"]] == ["tp=2", "dp_shard=1", "dp_shard=2", "tp=2"]


@pytest.mark.timeout(420)
def test_a_joiner_that_dies_while_the_next_world_forms_is_dropped_and_another_takes_its_place(tmp_path,
                                                                                               static_losses):
    """Admitted, the joiner dies before it forms the next world with the members, who form it while they train:
    they notice only by its stopped beats, warn, drop that world, and admit the next ready joiner; every state is
    kept and the losses are a static run's."""
    died = str(tmp_path / "died")
    members, joiners = launch_elastic(
        "elastic.py", 2, ["--layout", "dp_shard=2", "--steps", str(STEPS), "--switches", "1:dp_shard=3::ahead",
                          "--hold-for-joiner", "1", "--heartbeat", "0.2", "--timeout", "120"],
        tmp_path / "e", joiners=[["--die-when-admitted", died], ["--start-after", died]], timeout=360,
        joiners_may_die=True,
    )
    assert joiners[0] is None, "the first joiner was killed once admitted"
    for p in members + joiners[1:]:
        assert (p["layout"], p["world_size"], p["global_step"]) == ("dp_shard=3", 3, STEPS), p
    first = members[0]
    (report,) = first["reports"]
    assert report["verified"] and report["formed_ahead_steps"] >= 1, report
    assert any("was dropped" in w and "stopped beating" in w for w in first["warnings"]), first["warnings"]
    assert all(_close(a, b) for a, b in zip(first["losses"], static_losses)), (first["losses"], static_losses)
