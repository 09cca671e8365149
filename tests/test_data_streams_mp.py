"""The streaming pipelines LLM pretraining runs on, re-split online (tests/workers/stream_data.py, 4 processes): LitData
(`StreamingDataset` + `TokensLoader` + `StreamingDataLoader`, shuffled, 2 workers), a Hugging Face streaming dataset
(JSON Lines shards, a shuffle buffer per rank, split by node) read by a `DataLoader` and by torchdata's
`StatefulDataLoader`, and a `StatefulDataLoader` over a map-style dataset, trained together (one `CombinedLoader`).

Each keeps the order the run without switches reads: LitData and the map-style dataset because their library defines
it whatever the world size, the Hugging Face stream because the strategy keeps reading the first split's readers (the
rule for a per-rank buffer asks only that no sample be repeated or skipped in the epoch). 96 samples an epoch and a
global batch of 24: 4 steps an epoch."""

from __future__ import annotations

import pytest
from _launch import launch, launch_elastic
from _streams import write_jsonl, write_litdata

pytest.importorskip("litdata")
pytest.importorskip("datasets")
pytest.importorskip("torchdata")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

PIPELINES = ["litdata", "hf", "hf-stateful", "map-stateful"]


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    """The run without switches on 4 processes, 7 steps (into the second epoch), a checkpoint every 2 steps."""
    tmp = tmp_path_factory.mktemp("streams")
    # LitData's 101 samples: it cuts each epoch to 96, 12 whole batches on each rank, as it does for real data
    data = ["--litdata", str(write_litdata(tmp / "lit", 101)), "--hf", str(write_jsonl(tmp / "hf", 96, 8))]
    results = launch("stream_data.py", 4, [*data, "--steps", "7", "--save", f"2:{tmp / 'ckpt'}"], tmp / "static")
    return data, tmp / "ckpt", results[0]


def _assert_same_training(runs: list[dict], ref: dict) -> None:
    worst = dict.fromkeys(PIPELINES, 0.0)
    for res in runs:
        if res["left"]:
            continue
        first = len(ref["samples"]) - len(res["samples"])  # a joiner records the steps it trained
        assert res["samples"] == ref["samples"][first:], first
        for mine, theirs in zip(res["losses"], ref["losses"][first:]):
            for name in PIPELINES:
                assert abs(mine[name] - theirs[name]) <= 1e-5 * abs(theirs[name]), (name, mine, theirs)
                worst[name] = max(worst[name], abs(mine[name] - theirs[name]) / abs(theirs[name]))
    print("largest relative loss difference from the run without switches:",  # shown with pytest -s
          ", ".join(f"{name} {worst[name]:.1e}" for name in PIPELINES))


def test_without_switches_each_epoch_reads_every_sample_once(static):
    _, _, ref = static
    for name in PIPELINES:
        epoch = [i for step in ref["samples"][:4] for i in step[name]]
        assert len(set(epoch)) == len(epoch) == 96 and (name == "litdata" or set(epoch) == set(range(96))), name
        assert all(len(step[name]) == 24 for step in ref["samples"]), name
    assert ref["samples"][4] != ref["samples"][0]  # the second epoch in another order


def test_tp_a_scale_in_and_a_joiner_train_on_the_samples_of_the_run_without_switches(static, tmp_path):
    # dp_shard=2,tp=2 after step 1; 3 processes after step 3 (the epoch's last step follows on 3); a joiner admitted
    # after step 5, inside the second epoch
    data, _, ref = static
    args = ["--elastic", *data, "--switches", "1:dp_shard=2,tp=2;3:dp_shard=3;5:dp_shard=4"]
    members, joiners = launch_elastic("stream_data.py", 4, args, tmp_path, joiners=[args], timeout=400)
    assert sum(m["left"] for m in members) == 1
    assert [r["layout"] for r in members + joiners if not r["left"]] == ["dp_shard=4"] * 4
    assert all(r["errors"] == [] for r in members + joiners)
    assert len(joiners[0]["samples"]) == 1  # it trained step 6 from its admission on
    _assert_same_training(members + joiners, ref)


def test_a_checkpoint_saved_on_4_resumes_on_3_with_the_same_next_global_batches(static, tmp_path):
    data, ckpt, ref = static
    [saved] = ckpt.glob("*step=2.ckpt")  # inside the first epoch
    resumed = launch("stream_data.py", 3, [*data, "--steps", "7", "--layout", "dp_shard=3", "--resume", str(saved)],
                     tmp_path)
    assert all(r["global_step"] == 7 and r["accumulation"] == 4 for r in resumed)
    _assert_same_training(resumed, ref)
