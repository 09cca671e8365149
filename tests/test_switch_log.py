"""SwitchLog: one JSONL line per switch report, the layout on the progress bar, the switch table and loss plot."""

from __future__ import annotations

import json

from dynatrain.callbacks.switch_log import (
    JSONL_NAME, SwitchLog, format_switch_table, plot_loss_with_switches, read_switches, switch_metrics,
    switch_record,
)
from tests._rescale_fakes import FakeStrategy, RecordingLogger, fake_report, fake_trainer


def test_switch_log_alone_writes_jsonl_once_per_report_and_shows_the_layout(tmp_path):
    strategy = FakeStrategy("dp_shard=2")

    class Bar:
        def get_metrics(self, trainer, pl_module):
            return {"loss": 1.0}

    bar = Bar()
    trainer = fake_trainer(strategy, tmp_path, bar=bar)
    log = SwitchLog(log_dir=str(tmp_path))
    log.on_train_start(trainer, None)
    assert bar.get_metrics(trainer, None) == {"loss": 1.0, "layout": "dp_shard=2"}
    strategy.request_switch("tp=2")
    log.on_train_batch_end(trainer, None, None, None, 0)
    log.on_train_end(trainer, None)  # nothing new: no second line
    assert bar.get_metrics(trainer, None)["layout"] == "tp=2"
    (record,) = read_switches(tmp_path / JSONL_NAME)
    assert record["decision"] is None and record["verified"] is True and record["bytes_moved_identity"] == 2048
    log.teardown(trainer, None, "fit")
    assert "layout" not in bar.get_metrics(trainer, None)


def test_switch_log_on_other_ranks_writes_nothing(tmp_path):
    strategy = FakeStrategy("dp_shard=2")
    logger = RecordingLogger()
    trainer = fake_trainer(strategy, tmp_path, rank=1, loggers=[logger])
    log = SwitchLog(log_dir=str(tmp_path))
    log.on_train_start(trainer, None)
    strategy.request_switch("tp=2")
    assert len(log.flush(trainer)) == 1 and not log.flush(trainer)
    assert not (tmp_path / JSONL_NAME).exists() and not logger.calls


def test_a_decision_explains_only_the_switch_it_asked_for(tmp_path):
    strategy = FakeStrategy("dp_shard=2")
    trainer = fake_trainer(strategy, tmp_path)
    log = SwitchLog(log_dir=str(tmp_path))
    log.on_train_start(trainer, None)
    log.note_decision(0, {"source": "control", "target": "dp_replicate=2"})  # deferred, then never ran
    strategy.request_switch("tp=2")
    log.note_decision(2, {"source": "trace", "target": "dp_shard=2"})
    strategy.request_switch("dp_replicate=2")
    strategy.request_switch("dp_shard=2")
    assert [r["decision"] for r in log.flush(trainer)] == [None, None, {"source": "trace", "target": "dp_shard=2"}]


def test_metrics_leave_out_what_the_report_left_empty():
    report = fake_report(3, "tp=2", "dp_shard=2")
    report.bytes_moved_identity, report.verified = None, None
    metrics = switch_metrics(switch_record(report))
    assert "switch/bytes_moved_identity" not in metrics and metrics["switch/verified"] == 0.0


def test_switch_table_and_loss_plot(tmp_path):
    records = [switch_record(fake_report(2, "dp_shard=2", "tp=2"), {"source": "trace", "reason": "entry 0"}),
               switch_record(fake_report(4, "tp=2", "dp_shard=1"), {"source": "preemption"})]
    (tmp_path / JSONL_NAME).write_text("".join(json.dumps(r) + "\n" for r in records))
    table = format_switch_table(read_switches(tmp_path / JSONL_NAME))
    lines = table.splitlines()
    assert lines[0].split()[:5] == ["step", "from", "to", "world", "stall"]
    assert "dp_shard=2" in lines[2] and "trace" in lines[2] and "2->1" in lines[3] and "preemption" in lines[3]
    assert format_switch_table([fake_report(1, "tp=2", "dp_shard=2")]).splitlines()[2].split()[-1] == "direct"
    assert format_switch_table([]) == "no layout switches"
    csv_path = tmp_path / "metrics.csv"
    rows = ["epoch,step,train/loss,switch/stall_s"] + [f"0,{s},{6 - s * 0.5},".rstrip() for s in range(6)]
    csv_path.write_text("\n".join(rows + ["0,2,,0.1"]) + "\n")
    out = plot_loss_with_switches(csv_path, tmp_path / JSONL_NAME, tmp_path / "plots" / "loss.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
