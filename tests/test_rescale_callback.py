"""ElasticCallback without processes: from an agreed request to a decision, and the callback's hooks."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import time
from types import SimpleNamespace

import pytest

from dynatrain.callbacks.rescale import ElasticCallback
from dynatrain.callbacks.rescale_plan import NEEDS_ELASTIC, Unpriced, accepts_leave, plan_target
from dynatrain.callbacks.switch_log import JSONL_NAME, SwitchLog, read_switches
from dynatrain.signals.agreement import MergedRequest
from dynatrain.signals.request import ScaleRequest
from dynatrain.vps.parallel_config import ParallelConfig
from tests._rescale_fakes import (
    DEBUG, AheadFakeStrategy, ElasticFakeStrategy, FakeStrategy, RecordingLogger, WaitingFakeStrategy, fake_trainer,
)


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


# ------------------------------------------------------------------------------------------------ decisions
def _merged(devices=None, layout=None, leave=()):
    return MergedRequest(devices, layout, tuple(leave), "control", "test", 0, 0.0, ("control",))


def _planner(current: str):
    cb = ElasticCallback(switch_fixed_seconds=0.0)
    from dynatrain.policy import Workload
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


def test_a_device_count_the_policy_cannot_price_takes_the_survivors_fallback():
    # A model of the user's own has no zoo config for the policy: kept on the same count, the same tp where it
    # divides the new one, else pure FSDP.
    current = ParallelConfig.parse("dp_replicate=2,dp_shard=2,tp=2")
    for count, expected in ((8, "dp_replicate=2,dp_shard=2,tp=2"), (6, "dp_shard=3,tp=2"), (3, "dp_shard=3")):
        plan = plan_target(_merged(devices=count), current, 8,
                           planner=lambda n, leave: Unpriced(current, n, "no model config"), can_change_world=True)
        assert (plan.target.short() if plan.target else current.short()) == expected
        assert plan.action == ("keep" if count == 8 else "switch") and "not priced (no model config)" in plan.reason


def test_accepts_leave_reads_the_signature():
    assert not accepts_leave(FakeStrategy().request_switch)
    assert accepts_leave(ElasticFakeStrategy().request_switch)
    assert accepts_leave(lambda target, **kw: None)


# ------------------------------------------------------------------------------------------------ callback
def test_trace_switches_at_its_step_and_the_report_carries_the_decision(tmp_path):
    strategy = FakeStrategy("dp_shard=2")
    logger = RecordingLogger()
    trainer = fake_trainer(strategy, tmp_path, loggers=[logger])
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


def test_a_waiting_trace_entry_asks_the_strategy_to_hold_training_for_its_joiners(tmp_path):
    trace = [{"step": 1, "devices": 4, "wait": True}, {"step": 2, "devices": 2}]
    strategy = WaitingFakeStrategy("dp_shard=2")
    strategy.ready_standby = lambda: 1  # the warm pool, as rank 0 reads it
    trainer = fake_trainer(strategy, tmp_path)
    cb = _started(ElasticCallback(trace=trace, max_devices=4, log_dir=str(tmp_path)), trainer)
    for step in (1, 2):
        _step(cb, trainer, step)
    assert [ParallelConfig.parse(t).world_size for t, _ in strategy.requests] == [4, 2]
    assert strategy.waits == [True, False]
    assert [d.request for d in cb.decisions] == ["devices=4 wait", "devices=2"]
    assert [d.standby for d in cb.decisions] == [1, None]  # only a scale-out reports the pool
    records = read_switches(tmp_path / JSONL_NAME)
    assert records[0]["decision"]["request"] == "devices=4 wait"
    assert records[0]["decision"]["standby"] == 1
    cb.close()
    # A strategy whose request_switch has no `wait` still switches; the entry is taken without holding training.
    older = ElasticFakeStrategy("dp_shard=2")
    trainer = fake_trainer(older, tmp_path / "older")
    cb = _started(ElasticCallback(trace=trace[:1], max_devices=4, log_dir=str(tmp_path / "older")), trainer)
    _step(cb, trainer, 1)
    assert [ParallelConfig.parse(t).world_size for t, _ in older.requests] == [4]
    cb.close()


def test_switches_are_planned_ahead_unless_a_deadline_or_the_option_says_no(tmp_path):
    strategy = AheadFakeStrategy("dp_shard=4", world=4)
    trainer = fake_trainer(strategy, tmp_path)
    cb = _started(ElasticCallback(trace=[(1, "dp_shard=2,tp=2"), (2, 2)], log_dir=str(tmp_path)), trainer)
    for step in (1, 2):
        _step(cb, trainer, step)
    # A preempted rank must be gone before its deadline: that request switches where it is agreed.
    cb.hub.submit(ScaleRequest(leave=(1,), source="preemption", deadline=time.monotonic() + 30))
    _step(cb, trainer, 3)
    assert [(d.step, d.action, d.source) for d in cb.decisions] == [
        (1, "switch", "trace"), (2, "switch", "trace"), (3, "switch", "preemption")]
    assert strategy.ahead == [True, True, False]
    cb.close()
    strategy = AheadFakeStrategy("dp_shard=4", world=4)
    trainer = fake_trainer(strategy, tmp_path / "off")
    cb = _started(ElasticCallback(trace=[(1, "dp_shard=2,tp=2")], plan_ahead=False, log_dir=str(tmp_path / "off")),
                  trainer)
    _step(cb, trainer, 1)
    assert strategy.ahead == [False]
    cb.close()


def test_checks_only_at_boundaries_every_n_steps(tmp_path):
    strategy = FakeStrategy("dp_shard=2")
    trainer = fake_trainer(strategy, tmp_path)
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
    trainer = fake_trainer(strategy, tmp_path)
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
    trainer = fake_trainer(strategy, tmp_path)
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
    trainer = fake_trainer(strategy, tmp_path, rank=1)
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
    trainer = fake_trainer(strategy, tmp_path, rank=1)
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
    trainer = fake_trainer(strategy, tmp_path, rank=1)
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
    trainer = fake_trainer(strategy, tmp_path, rank=1)
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
    trainer = fake_trainer(strategy, tmp_path)
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
