"""Multi-process training under strategy="dynatrain" against a single-process run on the same global batch."""

import pytest
from _launch import assert_close, launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

STEPS = 5
COMMON = ["--steps", str(STEPS), "--global-batch", "8", "--micro-batch", "2", "--seq-len", "64"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    (res,) = launch("train.py", 1, [*COMMON, "--layout", "dp_shard=1"], tmp_path_factory.mktemp("ref"))
    assert res["accumulation"] == 4
    losses = res["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize(
    "layout,nprocs,expected",
    [
        ("auto", 2, "dp_replicate=1,dp_shard=2,tp=1"),
        ("dp_shard=2,tp=2", 4, "dp_replicate=1,dp_shard=2,tp=2"),
        ("dp_replicate=2,dp_shard=2", 4, "dp_replicate=2,dp_shard=2,tp=1"),
    ],
)
def test_layouts_match_single_process(reference, tmp_path, layout, nprocs, expected):
    results = launch("train.py", nprocs, [*COMMON, "--layout", layout], tmp_path)
    dp = int(expected.split("dp_replicate=")[1][0]) * int(expected.split("dp_shard=")[1][0])
    for res in results:
        assert res["layout"] == expected
        assert res["accumulation"] == 8 // (2 * dp)
        assert_close(res["losses"], reference)
    assert sorted({r["dp_rank"] for r in results}) == list(range(dp))


def test_sequence_parallel_matches_single_process(reference, tmp_path):
    results = launch("train.py", 4, [*COMMON, "--layout", "dp_shard=2,tp=2", "--sequence-parallel"], tmp_path)
    for res in results:
        assert_close(res["losses"], reference)


def test_strategy_parallelises_a_plain_transformer(reference, tmp_path):
    results = launch("train.py", 2, [*COMMON, "--layout", "tp=2", "--plain-module"], tmp_path)
    for res in results:
        assert_close(res["losses"], reference)


def test_llama_lm_runs_under_lightning_model_parallel(reference, tmp_path):
    results = launch("train.py", 2, [*COMMON, "--strategy", "lightning"], tmp_path)
    for res in results:
        assert res["accumulation"] == 2
        assert_close(res["losses"], reference)


def test_the_moe_model_trains_alike_under_lightning_model_parallel_and_dynatrain(tmp_path):
    moe = [*COMMON, "--model", "moe-debug"]
    [ours, _] = launch("train.py", 2, [*moe, "--layout", "dp_shard=2"], tmp_path / "dynatrain")
    for res in launch("train.py", 2, [*moe, "--strategy", "lightning"], tmp_path / "lightning"):
        assert_close(res["losses"], ours["losses"])


def test_dcp_checkpoint_from_4_ranks_resumes_on_2(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = launch("train.py", 4, [*COMMON[:1], "3", *COMMON[2:], "--layout", "dp_shard=2,tp=2", "--save", str(ckpt)],
                   tmp_path)
    assert_close(saved[0]["losses"], reference[:3])
    resumed = launch("train.py", 2, [*COMMON[:1], "4", *COMMON[2:], "--layout", "dp_shard=2", "--resume", str(ckpt)],
                     tmp_path)
    for res in resumed:
        assert res["global_step"] == 4
        assert len(res["losses"]) == 1
        assert_close(res["losses"], reference[3:4])


def test_loss_parallel_equals_the_gathered_loss(tmp_path):
    """tp=2: logits split over the vocabulary, cross entropy under `loss_parallel`, never gathered whole."""
    for res in launch("loss_parallel.py", 2, ["--layout", "tp=2"], tmp_path):
        split, gathered = res["split"], res["gathered"]
        assert split["logits_split"] and not gathered["logits_split"]
        assert abs(split["loss"] - gathered["loss"]) <= 1e-6 * abs(gathered["loss"])
        assert res["max_grad_rel_diff"] <= 1e-5, res["max_grad_rel_diff"]
