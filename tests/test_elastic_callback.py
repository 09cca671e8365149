"""ElasticCallback and SwitchLog: agreement and decisions without processes, then end to end on 2 gloo ranks."""

from __future__ import annotations

import csv
import itertools
import json
import logging
import os
import signal
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynatrain.callbacks.elastic import (
    NEEDS_ELASTIC, SLOT_BYTES, ElasticCallback, MergedRequest, Proposal, Slot, accepts_leave, decode_slot,
    encode_slot, merge_proposals, plan_target,
)
from dynatrain.callbacks.switch_log import (
    JSONL_NAME, SwitchLog, format_switch_table, plot_loss_with_switches, read_switches, switch_metrics,
    switch_record,
)
from dynatrain.elastic.signals import ScaleRequest
from dynatrain.models.configs import get_model_config
from dynatrain.strategies.switch import SwitchReport
from dynatrain.vps.parallel_config import ParallelConfig

DEBUG = get_model_config("debug").with_overrides(n_layers=2)


# ------------------------------------------------------------------------------------------------ fakes
class FakeStrategy:
    """What ElasticCallback uses of DynaTrainStrategy; request_switch checks like the real one, switches at once."""

    def __init__(self, layout: str = "dp_shard=2", world: int = 2) -> None:
        self.parallel_config = ParallelConfig.parse(layout)
        self.world_size = world
        self.positions = list(range(world))
        self.switch_budget_bytes = 256 << 20
        self.switch_reports: list = []
        self.requests: list = []
        self.boundary = True
        self.step = 0

    def at_step_boundary(self) -> bool:
        return self.boundary

    def model_config(self):
        return DEBUG

    def request_switch(self, target):
        target = ParallelConfig.parse(target).validate(DEBUG, self.world_size)
        self._apply(target, ())
        return target

    def _apply(self, target, leave) -> None:
        self.requests.append((target.short(), tuple(leave)))
        self.switch_reports.append(_report(self.step, self.parallel_config.short(), target.short()))
        self.parallel_config = target


class ElasticFakeStrategy(FakeStrategy):
    def request_switch(self, target, leave=()):
        target = ParallelConfig.parse(target)
        self._apply(target, leave)
        return target


def _report(step: int, old: str, new: str) -> SwitchReport:
    return SwitchReport(step=step, old_layout=old, new_layout=new, world_size=ParallelConfig.parse(new).world_size,
                        bytes_total=4096, bytes_moved=1024, bytes_moved_identity=2048, rounds=1, rank_map=[0, 1],
                        peak_bytes=8192, peak_bound=9000, verified=True,
                        phases={"plan": 0.01, "build": 0.02, "transfer": 0.03, "adopt": 0.04})


class RecordingLogger:
    def __init__(self) -> None:
        self.calls: list = []

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))


def _trainer(strategy, tmp_path: Path, rank: int = 0, **kw):
    data = SimpleNamespace(seq_len=64, global_batch_size=8, micro_batch_size=2)
    return SimpleNamespace(strategy=strategy, global_step=0, global_rank=rank, is_global_zero=rank == 0,
                           datamodule=data, precision="32-true", loggers=kw.get("loggers", []), callbacks=[],
                           progress_bar_callback=kw.get("bar"), log_dir=str(tmp_path), default_root_dir=str(tmp_path))


def _step(cb: ElasticCallback, trainer, step: int) -> None:
    trainer.global_step = trainer.strategy.step = step
    cb.on_train_batch_end(trainer, None, None, None, 0)
    for c in trainer.callbacks:
        if isinstance(c, SwitchLog):
            c.flush(trainer)


def _started(cb: ElasticCallback, trainer) -> ElasticCallback:
    cb.setup(trainer, None, "fit")
    for c in list(trainer.callbacks):
        c.on_train_start(trainer, None)
    cb.on_train_start(trainer, None)
    return cb


def _proposal(rank, wall, devices=None, layout=None, leave=(), source="control", deadline_in=None):
    return Proposal(rank, devices, layout, tuple(leave), source, f"from rank {rank}", wall, deadline_in)


# ------------------------------------------------------------------------------------------------ agreement
def test_slot_round_trip_and_size_limit():
    p = _proposal(3, 1234.5, layout="dp_shard=2,tp=2", leave=(3,), source="preemption", deadline_in=12.0)
    tensor = encode_slot(Slot(p, listening=True))
    assert tensor.numel() == SLOT_BYTES and str(tensor.dtype) == "torch.uint8"
    assert decode_slot(tensor) == Slot(p, True)
    assert decode_slot(encode_slot(Slot())) == Slot(None, False)
    with pytest.raises(ValueError, match="does not fit the 64-byte agreement slot"):
        encode_slot(Slot(p), size=64)


def test_proposal_carries_wall_time_and_remaining_grace():
    request = ScaleRequest(leave=(1,), source="preemption", received_at=100.0, deadline=130.0, reason="x" * 2000)
    p = Proposal.from_request(1, request, now_wall=5000.0, now_mono=110.0)
    assert p.wall_time == pytest.approx(4990.0) and p.deadline_in == pytest.approx(20.0)
    assert len(p.reason) == 512  # reasons grow when requests coalesce; the slot stays small


def test_merge_unites_leaving_ranks_and_the_latest_target_wins_in_any_order():
    proposals = [
        _proposal(0, 10.0, devices=3, source="control"),
        _proposal(1, 12.0, leave=(1,), source="preemption", deadline_in=25.0),
        _proposal(2, 11.0, layout="tp=2", source="file", leave=(2,)),
        None,
    ]
    merged = {merge_proposals(list(order)) for order in itertools.permutations(proposals)}
    assert len(merged) == 1
    (m,) = merged
    assert (m.devices, m.layout, m.leave, m.source, m.origin_rank) == (None, "tp=2", (1, 2), "file", 2)
    assert m.sources == ("control", "preemption", "file") and m.deadline_in == 25.0


def test_merge_ties_go_to_the_lowest_rank_and_a_bare_preemption_has_no_target():
    same = [_proposal(r, 7.0, layout="tp=2" if r else "dp_shard=2", source="trace") for r in (1, 0)]
    assert merge_proposals(same).layout == "dp_shard=2"
    bare = merge_proposals([None, _proposal(1, 3.0, leave=(1,), source="preemption")])
    assert (bare.devices, bare.layout, bare.leave, bare.source) == (None, None, (1,), "preemption")
    assert merge_proposals([None, None]) is None


# ------------------------------------------------------------------------------------------------ decisions
def _merged(devices=None, layout=None, leave=()):
    return MergedRequest(devices, layout, tuple(leave), "control", "test", 0, 0.0, ("control",))


def _planner(current: str):
    cb = ElasticCallback(switch_fixed_seconds=0.0)
    from dynatrain.planner.layouts import Workload
    work = Workload(DEBUG, seq_len=64, global_batch=8, micro_batch=2, compute_dtype="float32")
    return lambda count, leave: cb.policy.decide(cb.devices_for(count), work, current, leave=leave)


def test_an_explicit_layout_is_honoured_even_when_slower():
    plan = plan_target(_merged(layout="tp=2"), ParallelConfig.parse("dp_shard=2"), 2,
                       planner=_planner("dp_shard=2"), can_change_world=False)
    assert (plan.action, plan.target.short()) == ("switch", "tp=2")
    keep = plan_target(_merged(layout="dp_shard=2"), ParallelConfig.parse("dp_shard=2"), 2,
                       planner=_planner("dp_shard=2"), can_change_world=False)
    assert keep.action == "keep" and keep.target is None and "already on dp_shard=2" in keep.reason


def test_a_device_count_on_the_same_world_goes_through_the_pays_check():
    better = plan_target(_merged(devices=2), ParallelConfig.parse("tp=2"), 2, planner=_planner("tp=2"),
                         can_change_world=False)
    assert (better.action, better.target.short()) == ("switch", "dp_shard=2") and "saves" in better.reason
    best = plan_target(_merged(devices=2), ParallelConfig.parse("dp_shard=2"), 2, planner=_planner("dp_shard=2"),
                       can_change_world=False)
    assert best.action == "keep" and "already the best" in best.reason


def test_a_device_count_change_needs_the_elastic_device_manager():
    current = ParallelConfig.parse("dp_shard=2")
    for merged in (_merged(devices=1), _merged(layout="tp=4"), _merged(leave=(1,))):
        with pytest.raises(ValueError, match=NEEDS_ELASTIC):
            plan_target(merged, current, 2, planner=_planner("dp_shard=2"), can_change_world=False)
    shrink = plan_target(_merged(leave=(1,)), current, 2, planner=_planner("dp_shard=2"), can_change_world=True)
    assert (shrink.action, shrink.target.short()) == ("switch", "dp_shard=1")
    with pytest.raises(ValueError, match="no process would be left"):
        plan_target(_merged(leave=(0, 1)), current, 2, planner=_planner("dp_shard=2"), can_change_world=True)


def test_accepts_leave_reads_the_signature():
    assert not accepts_leave(FakeStrategy().request_switch)
    assert accepts_leave(ElasticFakeStrategy().request_switch)
    assert accepts_leave(lambda target, **kw: None)


# ------------------------------------------------------------------------------------------------ callback
def test_trace_switches_at_its_step_and_the_report_carries_the_decision(tmp_path):
    strategy = FakeStrategy("dp_shard=2")
    logger = RecordingLogger()
    trainer = _trainer(strategy, tmp_path, loggers=[logger])
    cb = _started(ElasticCallback(trace=[(2, "tp=2"), {"step": 4, "devices": 2}], switch_fixed_seconds=0.0,
                                  log_dir=str(tmp_path)), trainer)
    log = cb.switch_log
    assert log in trainer.callbacks
    for step in range(1, 6):
        _step(cb, trainer, step)
    assert strategy.requests == [("tp=2", ()), ("dp_shard=2", ())]
    assert [(d.step, d.action, d.source) for d in cb.decisions] == [(2, "switch", "trace"), (4, "switch", "trace")]
    assert "planner, 2 device(s): switch: dp_shard=2 saves" in cb.decisions[1].reason
    records = read_switches(tmp_path / JSONL_NAME)
    assert [(r["step"], r["old_layout"], r["new_layout"]) for r in records] == [
        (2, "dp_shard=2", "tp=2"), (4, "tp=2", "dp_shard=2")]
    assert records[0]["decision"]["source"] == "trace" and records[0]["decision"]["agreement_s"] >= 0
    assert records[0]["old_world_size"] == records[0]["world_size"] == 2
    steps = [step for step, metrics in logger.calls]
    assert steps == [2, 4]
    metrics = logger.calls[0][1]
    for key in ("switch/stall_s", "switch/bytes_moved", "switch/bytes_moved_identity", "switch/peak_bytes",
                "switch/world_size", "switch/plan_s", "switch/transfer_s", "switch/verified",
                "switch/agreement_s", "switch/signal_to_decision_s"):
        assert key in metrics, key
    assert metrics["switch/verified"] == 1.0 and metrics["switch/stall_s"] == pytest.approx(0.1)
    cb.on_fit_end(trainer, None)


def test_checks_only_at_boundaries_every_n_steps(tmp_path):
    strategy = FakeStrategy("dp_shard=2")
    trainer = _trainer(strategy, tmp_path)
    cb = _started(ElasticCallback(trace=[(1, "tp=2")], check_every_n_steps=3, log_dir=str(tmp_path)), trainer)
    strategy.boundary = False
    _step(cb, trainer, 3)
    assert not cb.decisions  # mid-accumulation: nothing is agreed
    strategy.boundary = True
    for step in (1, 2):
        _step(cb, trainer, step)
    assert not cb.decisions
    _step(cb, trainer, 3)
    assert [(d.step, d.target) for d in cb.decisions] == [(3, "tp=2")]
    cb.close()


def test_invalid_requests_are_rejected_with_a_logged_reason_and_training_goes_on(tmp_path, caplog):
    strategy = FakeStrategy("dp_shard=2")
    trainer = _trainer(strategy, tmp_path)
    cb = _started(ElasticCallback(trace=[(1, "tp=3"), (2, 1), (3, "dp_replicate=2")], max_devices=4,
                                  log_dir=str(tmp_path)), trainer)
    with caplog.at_level(logging.INFO, logger="dynatrain.elastic"):
        verdict = cb.hub.submit(ScaleRequest(devices=5, source="control"))
        for step in (1, 2, 3):
            _step(cb, trainer, step)
    assert not verdict.accepted and "above max_devices=4" in verdict.reason
    actions = [(d.step, d.action) for d in cb.decisions]
    assert actions == [(1, "reject"), (2, "reject"), (3, "switch")]
    assert NEEDS_ELASTIC in cb.decisions[0].reason and NEEDS_ELASTIC in cb.decisions[1].reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("tp=3" in w and NEEDS_ELASTIC in w for w in warnings), warnings
    assert any("above max_devices=4" in w for w in warnings), warnings
    assert strategy.parallel_config.short() == "dp_replicate=2"
    cb.close()


def test_a_strategy_refusal_is_recorded_not_raised(tmp_path):
    strategy = FakeStrategy("dp_shard=2")
    trainer = _trainer(strategy, tmp_path)
    trainer.datamodule = SimpleNamespace(seq_len=64, global_batch_size=3, micro_batch_size=1)

    def refuse(target):
        raise ValueError("cannot switch to tp=2: global_batch_size=3 is not a multiple of 2")

    strategy.request_switch = refuse
    cb = _started(ElasticCallback(trace=[(1, "tp=2")], log_dir=str(tmp_path)), trainer)
    _step(cb, trainer, 1)
    assert [(d.action, d.reason) for d in cb.decisions] == [
        ("reject", "cannot switch to tp=2: global_batch_size=3 is not a multiple of 2")]
    cb.close()


def test_preemption_scales_in_through_an_elastic_strategy_and_restores_the_handler(tmp_path):
    strategy = ElasticFakeStrategy("dp_shard=2")
    trainer = _trainer(strategy, tmp_path, rank=1)
    before = signal.getsignal(signal.SIGUSR1)
    cb = _started(ElasticCallback(preemption={"signum": "USR1", "grace_seconds": 40}, log_dir=str(tmp_path)),
                  trainer)
    assert signal.getsignal(signal.SIGUSR1) is not before
    os.kill(os.getpid(), signal.SIGUSR1)
    _step(cb, trainer, 1)
    (decision,) = cb.decisions
    assert (decision.action, decision.source, decision.leave, decision.target) == (
        "switch", "preemption", (1,), "dp_shard=1")
    assert strategy.requests == [("dp_shard=1", (1,))]
    cb.on_exception(trainer, None, RuntimeError("boom"))
    cb.teardown(trainer, None, "fit")  # closing twice is harmless
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_new_rank_0_takes_over_the_listeners_when_their_process_left(tmp_path, caplog):
    import socket

    strategy = FakeStrategy("dp_shard=2")
    trainer = _trainer(strategy, tmp_path, rank=1)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    watch = tmp_path / "scale.json"
    cb = _started(ElasticCallback(control={"token": "t", "port": port}, log_dir=str(tmp_path),
                                  watch_file={"path": str(watch), "poll_seconds": 0.02}), trainer)
    try:
        assert cb.control_server is None  # not rank 0
        trainer.global_rank = 0  # the old rank 0 left and the ranks were renumbered
        with caplog.at_level(logging.WARNING, logger="dynatrain.elastic"):
            _step(cb, trainer, 1)
            _step(cb, trainer, 2)
        # Its port is still held: warned once, retried at every check, training goes on.
        assert cb.control_server is None
        assert sum("cannot start the control server" in r.getMessage() for r in caplog.records) == 1
        busy.close()
        _step(cb, trainer, 3)
        assert cb.control_endpoint == f"127.0.0.1:{port}"
        watch.write_text('{"layout": "tp=2"}')
        deadline = time.monotonic() + 5
        while cb.hub.peek() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        _step(cb, trainer, 4)
        assert [(d.step, d.source, d.target) for d in cb.decisions] == [(4, "file", "tp=2")]
    finally:
        busy.close()
        cb.close()


def test_a_joiner_does_not_replay_the_trace_and_a_detached_process_stops(tmp_path):
    strategy = FakeStrategy("dp_shard=2")
    strategy.local_only = True  # a process entering a running job
    trainer = _trainer(strategy, tmp_path, rank=1)
    cb = _started(ElasticCallback(trace=[(2, "tp=2"), (6, "dp_shard=2")], log_dir=str(tmp_path)), trainer)
    strategy.local_only = False
    _step(cb, trainer, 5)
    assert not cb.decisions
    _step(cb, trainer, 6)
    assert [(d.step, d.action) for d in cb.decisions] == [(6, "keep")]
    strategy.detached = True
    cb.hub.submit(ScaleRequest(layout="tp=2", source="control"))
    _step(cb, trainer, 7)
    assert len(cb.decisions) == 1


def test_a_preemption_follows_the_rank_after_renumbering(tmp_path):
    strategy = ElasticFakeStrategy("dp_shard=2")
    trainer = _trainer(strategy, tmp_path, rank=1)
    before = signal.getsignal(signal.SIGUSR2)
    cb = _started(ElasticCallback(preemption={"signum": signal.SIGUSR2}, log_dir=str(tmp_path)), trainer)
    try:
        os.kill(os.getpid(), signal.SIGUSR2)  # queued naming rank 1
        trainer.global_rank = 0  # a world change renumbered this process before the boundary
        _step(cb, trainer, 1)
        assert [(d.source, d.leave) for d in cb.decisions] == [("preemption", (0,))]
        os.kill(os.getpid(), signal.SIGUSR2)
        _step(cb, trainer, 2)
        assert cb.decisions[1].leave == (0,)
    finally:
        cb.close()
    assert signal.getsignal(signal.SIGUSR2) is before


def test_control_token_file_is_created_owner_only_and_the_endpoint_written(tmp_path):
    strategy = FakeStrategy("dp_shard=2")
    trainer = _trainer(strategy, tmp_path)
    token_file = tmp_path / "secret" / "token"
    cb = _started(ElasticCallback(control={"token_file": str(token_file)}, log_dir=str(tmp_path)), trainer)
    try:
        info = json.loads((tmp_path / "control.json").read_text())
        assert info == {"endpoint": cb.control_endpoint, "token_file": str(token_file)}
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(token_file.read_text().strip()) >= 24
    finally:
        cb.close()
    assert cb.control_server is None


def test_configuration_mistakes_fail_before_training():
    with pytest.raises(ValueError, match="trace entry 1"):
        ElasticCallback(trace=[(1, 2), (1, 2)])
    with pytest.raises(ValueError, match="above max_devices=2"):
        ElasticCallback(trace=[(1, 4)], max_devices=2)
    with pytest.raises(ValueError, match="unknown option"):
        ElasticCallback(control={"hots": "127.0.0.1"})
    with pytest.raises(ValueError, match="check_every_n_steps"):
        ElasticCallback(check_every_n_steps=0)
    with pytest.raises(ValueError, match="watch_file needs a path"):
        ElasticCallback(watch_file={"poll_seconds": 1})


# ------------------------------------------------------------------------------------------------ switch log
def test_switch_log_alone_writes_jsonl_once_per_report_and_shows_the_layout(tmp_path):
    strategy = FakeStrategy("dp_shard=2")

    class Bar:
        def get_metrics(self, trainer, pl_module):
            return {"loss": 1.0}

    bar = Bar()
    trainer = _trainer(strategy, tmp_path, bar=bar)
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
    trainer = _trainer(strategy, tmp_path, rank=1, loggers=[logger])
    log = SwitchLog(log_dir=str(tmp_path))
    log.on_train_start(trainer, None)
    strategy.request_switch("tp=2")
    assert len(log.flush(trainer)) == 1 and not log.flush(trainer)
    assert not (tmp_path / JSONL_NAME).exists() and not logger.calls


def test_a_decision_explains_only_the_switch_it_asked_for(tmp_path):
    strategy = FakeStrategy("dp_shard=2")
    trainer = _trainer(strategy, tmp_path)
    log = SwitchLog(log_dir=str(tmp_path))
    log.on_train_start(trainer, None)
    log.note_decision(0, {"source": "control", "target": "dp_replicate=2"})  # deferred, then never ran
    strategy.request_switch("tp=2")
    log.note_decision(2, {"source": "trace", "target": "dp_shard=2"})
    strategy.request_switch("dp_replicate=2")
    strategy.request_switch("dp_shard=2")
    assert [r["decision"] for r in log.flush(trainer)] == [None, None, {"source": "trace", "target": "dp_shard=2"}]


def test_metrics_leave_out_what_the_report_left_empty():
    report = _report(3, "tp=2", "dp_shard=2")
    report.bytes_moved_identity, report.verified = None, None
    metrics = switch_metrics(switch_record(report))
    assert "switch/bytes_moved_identity" not in metrics and metrics["switch/verified"] == 0.0


def test_switch_table_and_loss_plot(tmp_path):
    records = [switch_record(_report(2, "dp_shard=2", "tp=2"), {"source": "trace", "reason": "entry 0"}),
               switch_record(_report(4, "tp=2", "dp_shard=1"), {"source": "preemption"})]
    (tmp_path / JSONL_NAME).write_text("".join(json.dumps(r) + "\n" for r in records))
    table = format_switch_table(read_switches(tmp_path / JSONL_NAME))
    lines = table.splitlines()
    assert lines[0].split()[:5] == ["step", "from", "to", "world", "stall"]
    assert "dp_shard=2" in lines[2] and "trace" in lines[2] and "2->1" in lines[3] and "preemption" in lines[3]
    assert format_switch_table([_report(1, "tp=2", "dp_shard=2")]).splitlines()[2].split()[-1] == "direct"
    assert format_switch_table([]) == "no layout switches"
    csv_path = tmp_path / "metrics.csv"
    rows = ["epoch,step,train/loss,switch/stall_s"] + [f"0,{s},{6 - s * 0.5},".rstrip() for s in range(6)]
    csv_path.write_text("\n".join(rows + ["0,2,,0.1"]) + "\n")
    out = plot_loss_with_switches(csv_path, tmp_path / JSONL_NAME, tmp_path / "plots" / "loss.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


# ------------------------------------------------------------------------------------------------ 2 gloo ranks
RECORD_FIELDS = {"step", "old_layout", "new_layout", "old_world_size", "world_size", "phases", "stall_s",
                 "bytes_total", "bytes_moved", "bytes_moved_identity", "peak_bytes", "verified", "decision", "time"}


def _launch(tmp_path: Path, *args: str) -> list[dict]:
    from _launch import launch

    return launch("elastic_cb.py", 2, ["--run-dir", str(tmp_path / "run"), *args], tmp_path, timeout=180)


def _finite(losses: list[float]) -> bool:
    return all(x == x and abs(x) < 1e6 for x in losses)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_trace_switches_and_back_with_reports_in_csv_jsonl_and_wandb(tmp_path):
    # Step 2: an explicit layout; step 4: a device count on the same world, which the planner turns back into
    # data parallelism because it pays.
    results = _launch(tmp_path, "--trace", json.dumps([[2, "tp=2"], [4, 2]]), "--steps", "6", "--wandb",
                      "--progress-bar")
    for res in results:
        assert res["global_step"] == 6 and len(res["losses"]) == 6 and _finite(res["losses"])
        assert [(r["step"], r["old_layout"], r["new_layout"]) for r in res["reports"]] == [
            (2, "dp_shard=2", "tp=2"), (4, "tp=2", "dp_shard=2")]
        assert all(r["verified"] for r in res["reports"])
        assert [(d["step"], d["action"], d["source"]) for d in res["decisions"]] == [
            (2, "switch", "trace"), (4, "switch", "trace")]
        assert res["layout"] == "dp_shard=2"
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["bar_layout"] == "dp_shard=2"
    log_dir = Path(results[0]["log_dir"])
    records = read_switches(log_dir / JSONL_NAME)
    assert len(records) == 2 and all(RECORD_FIELDS <= set(r) for r in records)
    assert records[1]["decision"]["request"] == "devices=2" and "pays" not in records[1]["decision"]["reason"]
    assert "planner, 2 device(s): switch: dp_shard=2 saves" in records[1]["decision"]["reason"]
    assert {"plan", "transfer", "adopt"} <= set(records[0]["phases"])
    with open(log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    switch_rows = {int(r["step"]): r for r in rows if r.get("switch/stall_s")}
    assert sorted(switch_rows) == [2, 4] and float(switch_rows[2]["switch/stall_s"]) > 0
    assert switch_rows[2]["switch/verified"] == "1.0" and float(switch_rows[2]["switch/bytes_moved"]) > 0
    (wandb_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    data = wandb_file.read_bytes()
    for key in (b"switch/stall_s", b"switch/bytes_moved_identity", b"switch/transfer_s", b"switch/table"):
        assert key in data, key
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/files/media/table/switch/*.table.json"))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_control_command_needs_the_token_and_a_malformed_file_is_rejected(tmp_path):
    actions = "1:control-wrong:tp=2;1:control:tp=2;3:file-bad;3:file:dp_shard=2"
    from _launch import retry_on_lost_peer

    runs = iter(range(2))
    results = retry_on_lost_peer(lambda: _launch(tmp_path / f"run{next(runs)}", "--control", "--watch", "--steps", "5",
                                                 "--actions", actions))
    rank0 = results[0]
    wrong, right = rank0["control"]
    assert wrong["exit"] == 1 and "wrong token" in wrong["output"]
    assert right["exit"] == 0 and '"accepted": true' in right["output"]
    rejected = [(r["source"], r["reason"]) for r in rank0["hub_rejected"]]
    assert rejected[0][0] == "control" and "HTTP 403" in rejected[0][1]
    assert rejected[1][0] == "file" and "Expecting ',' delimiter" in rejected[1][1]
    for res in results:
        assert res["global_step"] == 5 and _finite(res["losses"])
        assert [(r["step"], r["new_layout"]) for r in res["reports"]] == [(1, "tp=2"), (3, "dp_shard=2")]
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
