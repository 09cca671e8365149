"""The signal sources end to end: a real signal, a live HTTP server, a watched file, a trace."""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import signal
import socket
import threading
import time

import pytest

from dynatrain.cli import main as dynatrain_main
from dynatrain.signals import ControlServer, FileSource, PreemptionSource, SignalHub, TraceSource, is_loopback
from dynatrain.signals import control_server as control_mod
from tests._launch import replace_file, wait_for

TOKEN = "job-token-7f3a"


# ------------------------------------------------------------------------------------------------- preemption


def test_sigterm_queues_this_rank_leaving_and_keeps_the_process_alive():
    before = signal.getsignal(signal.SIGTERM)
    hub = SignalHub()
    try:
        source = PreemptionSource(hub, rank=3, grace_seconds=20.0)
        assert signal.getsignal(signal.SIGTERM) == source._handle
        os.kill(os.getpid(), signal.SIGTERM)
        request = wait_for(hub.poll)
    finally:
        hub.close()
    assert (request.leave, request.source, request.devices, request.layout) == ((3,), "preemption", None, None)
    assert request.deadline == pytest.approx(request.received_at + 20.0)
    assert source.deadline == request.deadline
    assert "SIGTERM" in request.reason
    assert signal.getsignal(signal.SIGTERM) is before


def test_repeated_signal_keeps_the_first_deadline_and_one_request():
    before = signal.getsignal(signal.SIGUSR1)
    hub = SignalHub()
    try:
        source = PreemptionSource(hub, rank=1, signum=signal.SIGUSR1, grace_seconds=5.0)
        os.kill(os.getpid(), signal.SIGUSR1)
        first = wait_for(lambda: source.deadline)
        time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        request = hub.poll()
        assert hub.poll() is None
    finally:
        hub.close()
    assert request.leave == (1,) and request.deadline == first
    assert signal.getsignal(signal.SIGUSR1) is before


def test_preemption_source_refuses_a_worker_thread():
    errors = []

    def install():
        try:
            PreemptionSource(SignalHub(), rank=0)
        except RuntimeError as err:
            errors.append(str(err))

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


# ---------------------------------------------------------------------------------------------------- control


@pytest.fixture
def control():
    hub = SignalHub(max_devices=8)
    server = ControlServer(hub, TOKEN)
    yield hub, server
    hub.close()


def _post(endpoint: str, body: bytes, token: str | None = TOKEN, content_type: str = "application/json",
          headers: dict | None = None) -> tuple[int, dict]:
    host, port = endpoint.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    all_headers = {"Content-Type": content_type, **(headers or {})}
    if token is not None:
        all_headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request("POST", "/scale", body=body, headers=all_headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_control_accepts_a_request_with_the_token(control):
    hub, server = control
    status, answer = _post(server.endpoint, b'{"devices": 3}')
    assert status == 200 and answer["accepted"] is True
    request = hub.poll()
    assert (request.devices, request.layout, request.leave, request.source) == (3, None, (), "control")
    status, answer = _post(server.endpoint, b'{"layout": "tp=2, dp_shard=2"}')
    assert status == 200 and answer["accepted"]
    assert hub.poll().layout == "dp_shard=2,tp=2"
    assert hub.rejected == []


@pytest.mark.parametrize("token", ["wrong", None, TOKEN + "x", ""])
def test_control_refuses_without_the_token(control, token):
    hub, server = control
    status, answer = _post(server.endpoint, b'{"devices": 3}', token=token)
    assert status == 403 and answer["accepted"] is False and "token" in answer["reason"]
    assert hub.poll() is None
    assert len(hub.rejected) == 1 and hub.rejected[0].source == "control"


@pytest.mark.parametrize("body, expected", [
    (b'{"devices": 3', "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[3]", "JSON object"),
    (b'{"devices": 3, "force": true}', "'force'"),
    (b'{"devices": 3, "layout": "tp=2"}', "exactly one"),
    (b"{}", "exactly one"),
    (b'{"devices": "3"}', "integer"),
    (b'{"devices": 0}', "at least 1"),
    (b'{"layout": "tp=two"}', "cannot parse"),
    (b'{"wait": true}', "exactly one"),
    (b'{"devices": 3, "wait": 1}', "wait must be true or false"),
    (b"[" * 20000 + b"]" * 20000, "not valid JSON"),  # nesting deep enough to exhaust the parser's recursion
])
def test_control_rejects_malformed_bodies(control, body, expected, caplog):
    hub, server = control
    with caplog.at_level(logging.WARNING, logger="dynatrain.elastic"):
        status, answer = _post(server.endpoint, body)
    assert status == 400 and not answer["accepted"] and expected in answer["reason"]
    assert hub.poll() is None
    assert expected in hub.rejected[-1].reason
    assert any(expected in r.getMessage() for r in caplog.records)


def test_control_rejects_non_json_content_type(control):
    hub, server = control
    status, answer = _post(server.endpoint, b"devices=3", content_type="application/x-www-form-urlencoded")
    assert status == 400 and "application/json" in answer["reason"]
    assert hub.poll() is None


def test_control_rejects_requests_beyond_the_limits(control):
    hub, server = control
    for body in (b'{"devices": 9}', b'{"layout": "dp_shard=4,tp=4"}'):
        status, answer = _post(server.endpoint, body)
        assert status == 422 and not answer["accepted"] and "max_devices=8" in answer["reason"]
    assert hub.poll() is None and len(hub.rejected) == 2


def test_control_refuses_oversized_bodies_without_reading_them(control):
    hub, server = control
    # Large enough that the client is still sending when the answer comes: it must get the answer, not a reset.
    status, answer = _post(server.endpoint, b'{"layout": "' + b" " * 800_000 + b'tp=2"}')
    assert status == 413 and str(64 * 1024) in answer["reason"]
    # A huge announced body that never comes: the answer must not wait for it.
    host, port = server.endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(f"POST /scale HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n".encode())
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.0 413")
    assert hub.poll() is None and len(hub.rejected) == 2


def test_control_refuses_a_non_loopback_client(control, monkeypatch):
    hub, server = control
    monkeypatch.setattr(control_mod, "_peer_host", lambda handler: "192.0.2.7")
    status, answer = _post(server.endpoint, b'{"devices": 3}')
    assert status == 403 and "loopback" in answer["reason"]
    assert hub.poll() is None
    assert all(is_loopback(host) for host in ("::1", "localhost", "127.0.0.2"))
    assert not is_loopback("192.0.2.7") and not is_loopback("0.0.0.0")


def test_control_binds_beyond_loopback_only_when_allowed():
    hub = SignalHub()
    with pytest.raises(ValueError, match="allow_remote"):
        ControlServer(hub, TOKEN, host="0.0.0.0")
    with pytest.raises(ValueError, match="token"):
        ControlServer(hub, "")
    server = ControlServer(hub, TOKEN, host="0.0.0.0", allow_remote=True)
    try:
        port = int(server.endpoint.rsplit(":", 1)[1])
        status, _ = _post(f"127.0.0.1:{port}", b'{"devices": 2}')
        assert status == 200 and hub.poll().devices == 2
    finally:
        hub.close()


def test_closing_the_hub_stops_the_server(control):
    hub, server = control
    hub.close()
    host, port = server.endpoint.rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=2)


# ------------------------------------------------------------------------------------------------- scale CLI


def test_scale_cli_against_a_live_server(control, capsys, monkeypatch):
    hub, server = control
    assert dynatrain_main(["scale", "--endpoint", server.endpoint, "--token", TOKEN, "--devices", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["accepted"] is True
    assert hub.poll().devices == 3

    monkeypatch.setenv("DYNATRAIN_TOKEN", TOKEN)
    assert dynatrain_main(["scale", "--endpoint", server.endpoint, "--layout", "dp_shard=2,tp=2"]) == 0
    request = hub.poll()
    assert (request.layout, request.wait) == ("dp_shard=2,tp=2", False)
    assert dynatrain_main(["scale", "--endpoint", server.endpoint, "--devices", "3", "--wait"]) == 0
    request = hub.poll()
    assert (request.devices, request.wait) == (3, True) and request.describe() == "devices=3 wait"
    capsys.readouterr()

    assert dynatrain_main(["scale", "--endpoint", server.endpoint, "--token", "nope", "--devices", "3"]) == 1
    assert json.loads(capsys.readouterr().out) == {"accepted": False, "reason": pytest.approx(
        "missing or wrong token: send 'Authorization: Bearer TOKEN' with the job's token")}
    assert dynatrain_main(["scale", "--endpoint", server.endpoint, "--devices", "9"]) == 1
    assert "max_devices" in json.loads(capsys.readouterr().out)["reason"]
    assert hub.poll() is None


def test_every_new_token_passes_as_the_scale_commands_argument(tmp_path):
    # One token in 64 began with '-' before: `--token -Xyz` is an option to argparse, and the command exited 2.
    from dynatrain.callbacks.rescale_options import new_token, read_or_create_token
    from dynatrain.cli.scale import configure

    parser = configure(argparse.ArgumentParser())
    tokens = [new_token() for _ in range(2000)] + [read_or_create_token(tmp_path / "token")]
    for token in tokens:
        assert parser.parse_args(["--endpoint", "127.0.0.1:1", "--token", token, "--devices", "2"]).token == token
    assert len(set(tokens)) == len(tokens) and min(map(len, tokens)) >= 32


def test_scale_cli_errors(capsys, monkeypatch):
    monkeypatch.delenv("DYNATRAIN_TOKEN", raising=False)
    assert dynatrain_main(["scale", "--endpoint", "127.0.0.1:1", "--devices", "3"]) == 2
    assert "DYNATRAIN_TOKEN" in capsys.readouterr().err
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert dynatrain_main(["scale", "--endpoint", f"127.0.0.1:{port}", "--token", "t", "--devices", "3"]) == 2
    assert "no answer" in capsys.readouterr().err
    assert dynatrain_main(["scale", "--endpoint", "nohost", "--token", "t", "--devices", "3"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dynatrain_main(["scale", "--endpoint", "127.0.0.1:1", "--devices", "3", "--layout", "tp=2"])


# ------------------------------------------------------------------------------------------------------- file


def test_file_source_submits_changes_and_rejects_malformed_content_once(tmp_path):
    path = tmp_path / "scale.json"
    hub = SignalHub(max_devices=8)
    try:
        replace_file(path, '{"devices": 3}')
        FileSource(hub, path, poll_seconds=0.02)
        request = wait_for(hub.poll)
        assert (request.devices, request.source) == (3, "file")

        replace_file(path, '{"devices": 3,')
        wait_for(lambda: hub.rejected)
        time.sleep(0.2)  # ten more polls of the same malformed content
        assert len(hub.rejected) == 1 and "scale.json" in hub.rejected[0].reason
        assert hub.poll() is None

        replace_file(path, '{"devices": 3, "why": 1}')
        wait_for(lambda: len(hub.rejected) == 2)
        assert "'why'" in hub.rejected[1].reason

        replace_file(path, '{"layout": "dp_shard=2,tp=2"}')
        assert wait_for(hub.poll).layout == "dp_shard=2,tp=2"
        time.sleep(0.1)
        assert hub.poll() is None and len(hub.rejected) == 2
    finally:
        hub.close()


def test_file_source_waits_for_the_file_and_stops_on_close(tmp_path):
    path = tmp_path / "later.json"
    hub = SignalHub()
    source = FileSource(hub, path, poll_seconds=0.02)
    time.sleep(0.1)
    assert hub.poll() is None and hub.rejected == []
    replace_file(path, '{"devices": 2}')
    assert wait_for(hub.poll).devices == 2
    hub.close()
    assert not source._thread.is_alive()
    replace_file(path, '{"devices": 4}')
    time.sleep(0.1)
    assert hub.poll() is None


# ------------------------------------------------------------------------------------------------------ trace


def test_trace_fires_each_entry_once_in_step_order():
    trace = TraceSource([(0, 4), {"step": 5, "devices": 2}, {"step": 9, "layout": "tp=2,dp_shard=2"}, [12, 4]])
    first = trace.due(0)
    assert [(r.devices, r.source) for r in first] == [(4, "trace")]
    assert trace.due(0) == [] and trace.due(4) == []
    late = trace.due(10)  # a step boundary skipped by the caller still fires what it passed, in order
    assert [(r.devices, r.layout) for r in late] == [(2, None), (None, "dp_shard=2,tp=2")]
    assert "entry 2" in late[1].reason
    assert trace.fired == 3 and len(trace) == 4
    assert [r.devices for r in trace.due(100)] == [4] and trace.due(200) == []
    assert not any(r.wait for r in first + late)


def test_a_trace_entry_may_hold_training_for_its_joiners():
    trace = TraceSource([{"step": 2, "devices": 3, "wait": True}, {"step": 4, "layout": "dp_shard=2", "wait": False},
                         (6, 4)])
    assert [(r.devices, r.wait) for r in trace.due(2)] == [(3, True)]
    assert [(r.layout, r.wait) for r in trace.due(4)] == [("dp_shard=2", False)]
    assert [(r.devices, r.wait) for r in trace.due(6)] == [(4, False)]


@pytest.mark.parametrize("entries, max_devices, expected", [
    ([(0, 2), (0, 3)], None, "entry 1"),
    ([(5, 2), (3, 3)], None, "increasing"),
    ([(-1, 2)], None, "entry 0 ((-1, 2)): step must be an integer >= 0"),
    ([(1.5, 2)], None, "step must be an integer"),
    ([(0, 2), (1, 0)], None, "entry 1 ((1, 0)): devices must be at least 1"),
    ([(0, True)], None, "device count"),
    ([(0, "tp=x")], None, "cannot parse"),
    ([{"step": 1, "devices": 2, "layout": "tp=2"}], None, "entry 0"),
    ([{"step": 1, "gpus": 2}], None, "'gpus'"),
    ([{"devices": 2}], None, "{step: N, devices: D}"),
    ([(0, 2, 3)], None, "(step, devices)"),
    ([(0, 2, True)], None, "as a dict to add wait: true"),
    ([{"step": 1, "devices": 2, "wait": "yes"}], None, "entry 0 ({'step': 1, 'devices': 2, 'wait': 'yes'}): wait must"),
    ([{"step": 1, "wait": True}], None, "optionally with wait: true"),
    ([(0, 2), (4, 16)], 8, "entry 1 ((4, 16)): devices=16, above max_devices=8"),
    ([(0, "dp_shard=4,tp=4")], 8, "needs 16 devices"),
    ("0:2", None, "list"),
])
def test_bad_traces_fail_at_construction_naming_the_entry(entries, max_devices, expected):
    with pytest.raises(ValueError) as err:
        TraceSource(entries, max_devices=max_devices)
    assert expected in str(err.value)


# ------------------------------------------------------------------------------------- coalescing and limits
