"""The hub: requests between two step boundaries coalesce, limits reject with a reason, and no source turns
received bytes into anything but JSON."""

from __future__ import annotations

import importlib
import inspect
import logging
import pkgutil
import threading

import pytest

import dynatrain.signals
from dynatrain.signals import ScaleRequest, SignalHub


def test_latest_request_wins():
    hub = SignalHub()
    hub.submit(ScaleRequest(devices=2, source="control"))
    hub.submit(ScaleRequest(layout="dp_shard=2,tp=2", source="file"))
    request = hub.poll()
    assert (request.devices, request.layout, request.source) == (None, "dp_shard=2,tp=2", "file")
    assert "coalesced" in request.reason
    assert hub.poll() is None


def test_preempted_ranks_stay_gone_across_coalesced_requests():
    hub = SignalHub()
    hub.submit(ScaleRequest(leave=(2,), source="preemption", deadline=50.0))
    hub.submit(ScaleRequest(leave=(0, 2), source="preemption", deadline=40.0))
    hub.submit(ScaleRequest(devices=3, source="control"))
    request = hub.poll()
    assert (request.devices, request.leave, request.deadline) == (3, (0, 2), 40.0)
    # A preemption after a target keeps the target: it names who leaves, not how many devices to run on.
    hub.submit(ScaleRequest(devices=3, source="control"))
    hub.submit(ScaleRequest(leave=(1,), source="preemption"))
    request = hub.poll()
    assert (request.devices, request.leave, request.source) == (3, (1,), "preemption")
    # ... and whether it waits for joiners.
    hub.submit(ScaleRequest(devices=4, source="control", wait=True))
    hub.submit(ScaleRequest(leave=(1,), source="preemption"))
    assert hub.poll().wait is True
    hub.submit(ScaleRequest(devices=4, source="control", wait=True))
    hub.submit(ScaleRequest(devices=2, source="file"))
    assert hub.poll().wait is False


def test_concurrent_submissions_coalesce_to_one():
    hub = SignalHub()

    def flood(n):
        for d in range(1, 51):
            hub.submit(ScaleRequest(devices=d, source="control", reason=f"thread {n}"))
        hub.submit(ScaleRequest(leave=(n,), source="preemption"))

    threads = [threading.Thread(target=flood, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    request = hub.poll()
    assert request.leave == tuple(range(6)) and request.devices == 50
    assert hub.poll() is None


def test_limits_reject_with_a_reason_and_training_goes_on(caplog):
    hub = SignalHub(max_devices=4)
    with caplog.at_level(logging.WARNING, logger="dynatrain.elastic"):
        verdict = hub.submit(ScaleRequest(devices=5))
        assert not hub.submit(ScaleRequest(layout="dp_shard=4,tp=2")).accepted
    assert not verdict.accepted and "max_devices=4" in verdict.reason
    assert hub.poll() is None
    assert [r.request.world_size for r in hub.rejected] == [5, 8]
    assert sum("max_devices=4" in r.getMessage() for r in caplog.records) == 2
    assert not hub.submit("devices=3").accepted
    assert hub.submit(ScaleRequest(devices=4)).accepted and hub.poll().devices == 4
    with pytest.raises(ValueError, match="at least 1"):
        ScaleRequest(devices=0)
    with pytest.raises(ValueError, match="not both"):
        ScaleRequest(devices=2, layout="tp=2")
    with pytest.raises(ValueError, match="target"):
        ScaleRequest()
    with pytest.raises(ValueError, match="wait needs a target"):
        ScaleRequest(leave=(1,), source="preemption", wait=True)
    with pytest.raises(ValueError, match="max_devices"):
        SignalHub(max_devices=0)


def test_no_signal_module_parses_anything_but_json():
    names = [m.name for m in pkgutil.iter_modules(dynatrain.signals.__path__)]
    assert {"control_server", "file", "hub", "preemption", "request", "trace", "agreement"} <= set(names)
    for name in ["__init__", *names]:
        module = dynatrain.signals if name == "__init__" else importlib.import_module(f"dynatrain.signals.{name}")
        source = inspect.getsource(module)
        for word in ("pickle", "marshal", "shelve", "yaml", "eval(", "exec(", "__import__", "subprocess"):
            assert word not in source, f"dynatrain.signals.{name} uses {word}"
