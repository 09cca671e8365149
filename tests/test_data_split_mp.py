"""The training switches, not only its state: a user's own dataloader around a stock Hugging Face Llama
(tests/workers/hf_data.py) is re-split at every switch, so every step trains on the samples it trains on without
switches, and its global loss is the same."""

from __future__ import annotations

import pytest
from _launch import launch, launch_elastic, selfcheck_module

pytest.importorskip("transformers")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

SAME_WORLD = "2:dp_replicate=2,dp_shard=2;4:dp_shard=2,tp=2"


def _assert_same_training(runs: list[dict], static: list[dict]) -> None:
    ref = static[0]
    for res in runs:
        if res["left"]:
            continue
        assert len(res["losses"]) >= 1
        first = len(ref["losses"]) - len(res["losses"])  # a joiner records the steps it trained
        for a, b in zip(res["losses"], ref["losses"][first:]):
            assert abs(a - b) <= 1e-5 * abs(b), (res["losses"], ref["losses"])
        assert res["samples"] == ref["samples"][first:]
        assert all(r["verified"] is True for r in res["reports"])


@pytest.mark.parametrize("data,shuffle,workers", [("map", True, 0), ("map", False, 0), ("sampler", False, 0),
                                                  ("map", True, 2)],
                         ids=["shuffled", "in-order", "users-sampler", "loader-workers"])
def test_switches_through_dp_replicate_and_tp_train_on_the_same_samples_as_without(tmp_path, data, shuffle, workers):
    # validation at the end of the first epoch, right after the switch to tp=2 (the val loader is re-split too);
    # with DataLoader workers, what they read ahead under the old split is dropped at each switch
    common = ["--data", data, "--steps", "6", "--val", "20", "--workers", str(workers),
              *(["--shuffle"] if shuffle else [])]
    static = launch("hf_data.py", 4, common, tmp_path / "static")
    switched = launch("hf_data.py", 4, [*common, "--switches", SAME_WORLD], tmp_path / "switched")
    assert all(r["layout"] == "dp_shard=2,tp=2" and r["accumulation"] == 6 for r in switched)
    assert [len(r["reports"]) for r in switched] == [2] * 4
    _assert_same_training(switched, static)
    # 96 samples, a global batch of 24: the epoch ends after step 4 under every split, and the next one begins
    assert sorted(i for step in static[0]["samples"][:4] for i in step) == list(range(96))
    for res in switched:
        assert res["val_samples"] == static[0]["val_samples"] == [list(range(20))]
        assert abs(res["val_losses"][0] - static[0]["val_losses"][0]) <= 1e-5 * static[0]["val_losses"][0]


@pytest.mark.parametrize("out_at", [4, 3], ids=["inside-an-epoch", "at-an-epoch-end"])
def test_a_scale_in_and_out_keeps_every_global_batch(tmp_path, out_at):
    # 4 steps an epoch: the scale-in after step 2; the joiner enters after step 5, inside the second epoch, or after
    # step 4, the first epoch's last
    common = ["--shuffle", "--steps", "6"]
    static = launch("hf_data.py", 4, common, tmp_path / "static")
    args = ["--elastic", *common, "--switches", f"1:dp_shard=3;{out_at}:dp_shard=4"]
    members, joiners = launch_elastic("hf_data.py", 4, args, tmp_path / "elastic", joiners=[args], timeout=400)
    assert sum(m["left"] for m in members) == 1
    assert [r["layout"] for r in members + joiners if not r["left"]] == ["dp_shard=4"] * 4
    _assert_same_training(members + joiners, static)


def test_world_changes_planned_ahead_form_their_world_while_training_and_keep_every_global_batch(tmp_path):
    # Planned ahead, the scale-in's members form the three-process world (its mesh's and control groups with it)
    # while steps go on, and the scale-out's with the joiner, admitted from where it waits as soon as it is ready.
    common = ["--shuffle", "--steps", "7"]
    static = launch("hf_data.py", 4, common, tmp_path / "static")
    args = ["--elastic", "--ahead", *common, "--switches", "1:dp_shard=3;3:dp_shard=4"]
    members, joiners = launch_elastic("hf_data.py", 4, args, tmp_path / "elastic", joiners=[args], timeout=400)
    assert sum(m["left"] for m in members) == 1
    assert [r["layout"] for r in members + joiners if not r["left"]] == ["dp_shard=4"] * 4
    stayed = [m for m in members if not m["left"]]
    assert all([r["new_layout"] for r in m["reports"]] == ["dp_shard=3", "dp_shard=4"] for m in stayed)
    # The scale-in formed while at least a step trained; the scale-out, holding training for its joiner, formed at
    # the boundary that admitted it (0 steps, not None: not in the stall).
    for m in stayed:
        scale_in, scale_out = (r["formed_ahead_steps"] for r in m["reports"])
        assert scale_in >= 1 and scale_out == 0, m["reports"]
    _assert_same_training(members + joiners, static)


def test_a_protocol_stream_is_re_split_exactly(tmp_path):
    common = ["--data", "protocol", "--shuffle", "--steps", "5"]
    static = launch("hf_data.py", 4, common, tmp_path / "static")
    switched = launch("hf_data.py", 4, [*common, "--switches", "2:dp_shard=2,tp=2;3:dp_replicate=2,dp_shard=2"],
                      tmp_path / "switched")
    assert all(r["errors"] == [] for r in switched)
    _assert_same_training(switched, static)


def test_a_stream_that_cannot_be_re_split_is_refused_at_request_time_and_training_goes_on(tmp_path):
    results = launch("hf_data.py", 4, ["--data", "stream", "--steps", "4", "--switches", "2:dp_shard=2,tp=2"],
                     tmp_path)
    for res in results:
        [error] = res["errors"]
        assert "PlainStream" in error and "set_data_parallel" in error, error
        assert res["layout"] == "dp_shard=4" and res["reports"] == [] and len(res["losses"]) == 4


def test_the_batch_guard_names_the_ranks_of_a_tp_group_that_read_different_batches(tmp_path):
    results = launch("hf_data.py", 4, ["--data", "broken", "--layout", "dp_shard=2,tp=2", "--steps", "2",
                                       "--check-batches"], tmp_path)
    for res in results:
        assert res["error"] is not None and "BatchMismatchError" in res["error"], res
        assert "ranks [0, 1] share data-parallel rank 0" in res["error"] and "step 0" in res["error"], res["error"]


@pytest.mark.parametrize("devices,at", [(2, 3), (3, 3), (3, 5)], ids=["2-mid-epoch", "3-mid-epoch", "3-epoch-end"])
def test_a_checkpoint_taken_on_4_resumes_on_fewer_with_the_same_next_global_batches(tmp_path, devices, at):
    common = ["--shuffle", "--samples", "120"]  # 5 steps of 24 an epoch
    static = launch("hf_data.py", 4, [*common, "--steps", "7"], tmp_path / "static")
    launch("hf_data.py", 4, [*common, "--steps", str(at + 1), "--save", f"{at}:{tmp_path / 'ckpt'}"],
           tmp_path / "first")
    [ckpt] = (tmp_path / "ckpt").glob(f"*step={at}*")  # inside the first epoch, or at its last step
    resumed = launch("hf_data.py", devices, [*common, "--steps", "7", "--layout", f"dp_shard={devices}",
                                              "--resume", str(ckpt)], tmp_path / "resumed")
    for res in resumed:
        assert res["global_step"] == 7 and res["accumulation"] == 24 // (2 * devices)
        assert len(res["losses"]) == 7 - at
        for a, b in zip(res["losses"], static[0]["losses"][at:]):
            assert abs(a - b) <= 1e-5 * abs(b), (res["losses"], static[0]["losses"])
        assert res["samples"] == static[0]["samples"][at:]


def test_selfcheck_module_checks_a_users_own_dataloader_through_tp_and_a_scale_in_and_out():
    layouts = ["dp_shard=4", "dp_shard=2,tp=2", "dp_shard=3", "dp_replicate=2,dp_shard=2"]
    result = selfcheck_module("hf_selfcheck:HFModule", layouts)
    assert result["samples_equal"] and result["loss_max_rel_diff"] <= 1e-5
    # the global batch is kept whole (24 = lcm of the data-parallel sizes x the loader's batch of 2) at every step
    assert [len(step) for step in result["samples"]] == [24] * 4


def test_the_zoo_data_module_ends_its_epochs_where_it_would_after_a_switch(tmp_path):
    # 11 steps an epoch; a switch after step 3 changes the micro-batches per step from 1 to 2: Lightning's epoch
    # length must follow (its loop, its combined loader and its fetcher each measured it), at the switch and at the
    # next epoch's start, or it closes a step with half its micro-batches.
    common = ["--layout", "dp_shard=4", "--steps", "24", "--corpus-bytes", "3000"]
    static = launch("user_switch.py", 4, common, tmp_path / "static")
    switched = launch("user_switch.py", 4, [*common, "--switches", "3:dp_shard=2,tp=2"], tmp_path / "switched")
    for a, b in zip(switched[0]["losses"], static[0]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (switched[0]["losses"], static[0]["losses"])


def test_limit_train_batches_keeps_the_same_samples_an_epoch_on_every_split(tmp_path):
    # 6 micro-batches of 4 ranks an epoch: 2 steps of 24 of the 96 samples, then a new epoch's order; the same under
    # HSDP and under tp=2, where each rank reads 12 micro-batches an epoch.
    common = ["--shuffle", "--steps", "6", "--limit", "6"]
    static = launch("hf_data.py", 4, common, tmp_path / "static")
    switched = launch("hf_data.py", 4, [*common, "--switches", "1:dp_replicate=2,dp_shard=2;3:dp_shard=2,tp=2"],
                      tmp_path / "switched")
    _assert_same_training(switched, static)
    steps = static[0]["samples"]
    assert all(len(step) == 24 for step in steps) and len({tuple(step) for step in steps}) == 6
