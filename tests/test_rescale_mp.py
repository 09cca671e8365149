"""ElasticCallback end to end on 2 gloo ranks: trace, control command, watched file and preemption."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from dynatrain.callbacks.switch_log import JSONL_NAME, read_switches


RECORD_FIELDS = {"step", "old_layout", "new_layout", "old_world_size", "world_size", "phases", "stall_s",
                 "bytes_total", "bytes_moved", "bytes_moved_identity", "peak_bytes", "verified", "decision", "time"}


def _launch(tmp_path: Path, *args: str) -> list[dict]:
    from _launch import launch

    return launch("rescale_callback.py", 2, ["--run-dir", str(tmp_path / "run"), *args], tmp_path, timeout=180)


def _finite(losses: list[float]) -> bool:
    return all(x == x and abs(x) < 1e6 for x in losses)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_trace_switches_and_back_with_reports_in_csv_jsonl_and_wandb(tmp_path):
    # Step 2: an explicit layout; step 4: a device count on the same world, which the planner turns back into
    # data parallelism because it pays. Each is planned while one more step trains and runs at its end.
    results = _launch(tmp_path, "--trace", json.dumps([[2, "tp=2"], [4, 2]]), "--steps", "6", "--wandb",
                      "--progress-bar")
    for res in results:
        assert res["global_step"] == 6 and len(res["losses"]) == 6 and _finite(res["losses"])
        assert [(r["step"], r["old_layout"], r["new_layout"]) for r in res["reports"]] == [
            (3, "dp_shard=2", "tp=2"), (5, "tp=2", "dp_shard=2")]
        assert all(r["verified"] and r["prepared"] for r in res["reports"])
        assert [(d["step"], d["action"], d["source"]) for d in res["decisions"]] == [
            (2, "switch", "trace"), (4, "switch", "trace")]
        assert res["layout"] == "dp_shard=2"
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["bar_layout"] == "dp_shard=2"
    log_dir = Path(results[0]["log_dir"])
    records = read_switches(log_dir / JSONL_NAME)
    assert len(records) == 2 and all(RECORD_FIELDS <= set(r) and r["prepared"] for r in records)
    assert records[1]["decision"]["request"] == "devices=2" and "pays" not in records[1]["decision"]["reason"]
    assert "planner, 2 device(s): switch: dp_shard=2 saves" in records[1]["decision"]["reason"]
    assert {"plan", "transfer", "adopt"} <= set(records[0]["phases"])
    with open(log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    switch_rows = {int(r["step"]): r for r in rows if r.get("switch/stall_s")}
    assert sorted(switch_rows) == [3, 5] and float(switch_rows[3]["switch/stall_s"]) > 0
    assert switch_rows[3]["switch/verified"] == "1.0" and float(switch_rows[3]["switch/bytes_moved"]) > 0
    assert switch_rows[3]["switch/prepared"] == "1.0"
    (wandb_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    data = wandb_file.read_bytes()
    for key in (b"switch/stall_s", b"switch/bytes_moved_identity", b"switch/transfer_s", b"switch/table"):
        assert key in data, key
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/files/media/table/switch/*.table.json"))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_control_command_needs_the_token_and_a_malformed_file_is_rejected(tmp_path):
    actions = "1:control-wrong:tp=2;1:control:tp=2;3:file-bad;3:file:dp_shard=2"
    results = _launch(tmp_path, "--control", "--watch", "--steps", "5", "--actions", actions)
    rank0 = results[0]
    wrong, right = rank0["control"]
    assert wrong["exit"] == 1 and "wrong token" in wrong["output"]
    assert right["exit"] == 0 and '"accepted": true' in right["output"]
    rejected = [(r["source"], r["reason"]) for r in rank0["hub_rejected"]]
    assert rejected[0][0] == "control" and "HTTP 403" in rejected[0][1]
    assert rejected[1][0] == "file" and "Expecting ',' delimiter" in rejected[1][1]
    for res in results:
        assert res["global_step"] == 5 and _finite(res["losses"])
        assert [(r["step"], r["new_layout"]) for r in res["reports"]] == [(2, "tp=2"), (4, "dp_shard=2")]
        assert [(d["step"], d["source"], d["action"]) for d in res["decisions"]] == [
            (1, "control", "switch"), (3, "file", "switch")]
    control = json.loads((Path(rank0["log_dir"]) / "control.json").read_text())
    assert control["endpoint"] == rank0["control_endpoint"] and control["token_file"].endswith("token")
    sources = [r["decision"]["source"] for r in read_switches(Path(rank0["log_dir"]) / JSONL_NAME)]
    assert sources == ["control", "file"]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_invalid_requests_are_rejected_and_training_ends_on_the_same_layout(tmp_path):
    # A global batch of 2 with micro-batch 2: tp=2 runs, but two data-parallel ranks cannot keep the batch.
    # Step 4: rank 1 gets SIGTERM; the job cannot scale in without an elastic device manager, and rank 1 lives on.
    trace = [[1, "tp=3"], [2, "dp_shard=2"], [3, 1], [5, 2]]
    results = _launch(tmp_path, "--layout", "tp=2", "--global-batch", "2", "--micro-batch", "2", "--steps", "6",
                      "--max-devices", "3", "--control", "--preemption", "--trace", json.dumps(trace),
                      "--actions", "1:control-devices:4;4:preempt:1")
    (refused,) = results[0]["control"]
    assert refused["exit"] == 1 and "above max_devices=3" in refused["output"]
    for res in results:
        assert res["global_step"] == 6 and len(res["losses"]) == 6 and _finite(res["losses"])
        assert res["layout"] == "tp=2" and res["reports"] == []
        decisions = [(d["step"], d["action"], d["source"]) for d in res["decisions"]]
        assert decisions == [(1, "reject", "trace"), (2, "reject", "trace"), (3, "reject", "trace"),
                             (4, "reject", "preemption"), (5, "keep", "trace")]
        assert res["decisions"][3]["leave"] == [1]  # rank 1's signal reached every rank
        reasons = [d["reason"] for d in res["decisions"]]
        # Refused by this callback, or by a strategy whose request_switch takes `leave` but has no elastic manager.
        assert all("elastic" in reasons[i] for i in (0, 2, 3)), reasons
        assert "cannot switch to dp_shard=2: global_batch_size=2 is not a multiple of" in reasons[1]
        assert "already the best" in reasons[4]
    assert not (Path(results[0]["log_dir"]) / JSONL_NAME).exists()
