"""Bad input is refused with an error that names what to change, and nothing of the running job changes.

Cases already shown elsewhere are listed in docs/reliability.md with their tests; this file holds the rest:
the strategy's request path, `dynatrain fit` refusing a layout before any process starts, the elastic
launcher, registration of a mismatched joiner, malformed signal files, the control path's security, and one
2-process run whose state stays bitwise unchanged through a series of refused requests.
"""

from __future__ import annotations

import http.client
import inspect
import json
import pickle
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from dynatrain.signals import control_server as signals
from tests._launch import replace_file, wait_for
from dynatrain.signals import ControlServer, FileSource, SignalHub
from dynatrain.models.configs import get_model_config

REPO = Path(__file__).resolve().parent.parent
DEBUG = get_model_config("debug")  # 8 heads, 4 KV heads, ffn 768, vocab 512
TOKEN = "bad-input-token-5c1e"


# ------------------------------------------------------------------------------------ the strategy's request path
def _switcher(world: int = 4, model=DEBUG, global_batch: int = 6, micro_batch: int = 1, max_devices=None):
    """The real `SwitchOrchestrator` on a stand-in strategy: `request` checks without any process group."""
    from dynatrain.data import LlamaDataModule
    from dynatrain.strategies.switch_orchestrator import SwitchOrchestrator

    elastic = None if max_devices is False else SimpleNamespace(config=SimpleNamespace(max_devices=max_devices))
    strategy = SimpleNamespace(world_size=world, model_config=lambda: model, elastic=elastic)
    switcher = SwitchOrchestrator(strategy)
    data = LlamaDataModule(seq_len=32, global_batch_size=global_batch, micro_batch_size=micro_batch)
    switcher.trainer = SimpleNamespace(training=True, global_step=0, datamodule=data)  # mid-training: requests are queued
    return switcher


@pytest.mark.parametrize("model, target, expected", [
    (DEBUG, "tp=4", None),
    (DEBUG.with_overrides(n_heads=2, n_kv_heads=2), "tp=4", "tp=4 does not divide n_heads=2 of model 'debug': "
                                                           "choose a tp that divides 2"),
    (DEBUG.with_overrides(n_kv_heads=2), "tp=4", "tp=4 does not divide n_kv_heads=2"),
    (DEBUG.with_overrides(ffn_dim=770), "tp=4", "tp=4 does not divide ffn_dim=770"),
    (DEBUG.with_overrides(vocab_size=514), "tp=4", "tp=4 does not divide vocab_size=514"),
])
def test_a_tp_that_does_not_divide_the_model_is_refused_and_nothing_is_queued(model, target, expected):
    switcher = _switcher(model=model, max_devices=False)
    if expected is None:
        assert switcher.request(target).short() == target and switcher.pending.target.short() == target
        return
    with pytest.raises(ValueError) as err:
        switcher.request(target)
    assert expected in str(err.value)
    assert switcher.pending is None


def test_a_layout_for_another_device_count_needs_an_elastic_job():
    switcher = _switcher(world=4, max_devices=False)
    for target, n in (("dp_shard=3", 3), ("dp_shard=4,tp=2", 8)):
        with pytest.raises(ValueError) as err:
            switcher.request(target)
        assert (f"{target} needs dp_replicate*dp_shard*tp = {n} devices, but there are 4: changing the number of "
                f"processes needs an elastic job") in str(err.value)
    with pytest.raises(ValueError, match=r"leave=\[4\]: ranks \[4\] are not in the current world of 4 processes"):
        switcher.request("dp_shard=4", leave=[4])
    assert switcher.pending is None


def test_a_global_batch_the_new_data_parallel_size_cannot_keep_is_refused():
    switcher = _switcher(world=4, global_batch=6, micro_batch=1, max_devices=False)
    with pytest.raises(ValueError) as err:
        switcher.request("dp_shard=4")
    assert str(err.value) == ("cannot switch to dp_shard=4: global_batch_size=6 is not a multiple of "
                              "dp_size*micro_batch_size = 4*1 = 4: use a multiple of 4 such as 4 or 8")
    assert switcher.pending is None
    assert switcher.request("dp_shard=2,tp=2").short() == "dp_shard=2,tp=2"  # 6 = 2 ranks x 3 micro-batches


def test_an_elastic_job_refuses_zero_devices_and_more_than_max_devices():
    switcher = _switcher(world=4, max_devices=4)
    with pytest.raises(ValueError, match="dp_shard=8 needs 8 processes, above elastic max_devices=4"):
        switcher.request("dp_shard=8")
    for zero in ("dp_shard=0", "tp=0,dp_shard=2"):
        with pytest.raises(ValueError, match="must be a positive integer, got 0"):
            switcher.request(zero)
    assert switcher.pending is None
    assert switcher.request("dp_shard=3").world_size == 3  # within the cap: queued for the next boundary


def test_requests_before_a_boundary_coalesce_and_a_bad_one_leaves_the_pending_one():
    switcher = _switcher(world=4, max_devices=False)
    switcher.request("dp_shard=2,tp=2")
    switcher.request("tp=4")
    assert switcher.pending.target.short() == "tp=4"  # the latest wins; one switch at the boundary
    with pytest.raises(ValueError):
        switcher.request("tp=3")
    assert switcher.pending.target.short() == "tp=4"


def test_a_switch_budget_must_be_positive():
    from dynatrain import DynaTrainStrategy

    for budget in (0, -1.0):
        with pytest.raises(ValueError, match=f"switch_budget_mb must be positive, got {budget}"):
            DynaTrainStrategy(switching={"switch_budget_mb": budget})


# ------------------------------------------------------------------------------------------------ dynatrain fit
def _fit(monkeypatch, tmp_path, *args: str, config: Path | None = None) -> None:
    """`dynatrain fit` on the debug recipe in this process; a refusal must come before training starts."""
    from dynatrain.cli.train import run_lightning_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["dynatrain"])
    monkeypatch.delenv("DYNATRAIN_JOIN", raising=False)
    monkeypatch.setattr("lightning.pytorch.Trainer.fit", lambda *a, **k: pytest.fail("training started"))
    run_lightning_cli(["fit", "--config", str(config or REPO / "recipes/llama-debug.yaml"), *args,
                       "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)])


@pytest.mark.parametrize("args, expected", [
    (["--trainer.strategy.init_args.parallel", "tp=3"],
     "needs dp_replicate*dp_shard*tp = 3 devices, but there are 2: change the layout so the product is 2"),
    (["--trainer.devices", "3", "--trainer.strategy.init_args.parallel", "tp=3"],
     "tp=3 does not divide n_heads=8 of model 'debug': choose a tp that divides 8"),
    (["--trainer.devices", "3", "--trainer.strategy.init_args.parallel", "auto"],
     "layout dp_shard=3 on 3 devices: global_batch_size=16 is not a multiple of dp_size*micro_batch_size = "
     "3*4 = 12: use a multiple of 12 such as 12 or 24"),
])
def test_fit_refuses_a_layout_before_any_process_starts(monkeypatch, tmp_path, capsys, args, expected):
    with pytest.raises(SystemExit) as exit_info:
        _fit(monkeypatch, tmp_path, *args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "dynatrain fit: error: " in err and expected in err, err


def test_fit_names_the_known_models_for_an_unknown_one(monkeypatch, tmp_path):
    known = r"choose a dense one \(debug, 125m, 350m, 1b.*or a mixture of experts \(moe-debug"
    with pytest.raises(ValueError, match=f"unknown model 'llama-9000'; {known}"):
        _fit(monkeypatch, tmp_path, "--model.model", "llama-9000")


@pytest.mark.parametrize("section, key, typo", [
    ("data", "global_batch_size", "global_batchsize"),
    ("model", "lr", "lrate"),
    ("trainer", "max_steps", "max_step"),
])
def test_fit_refuses_an_unknown_recipe_key_by_name(monkeypatch, tmp_path, capsys, section, key, typo):
    cfg = yaml.safe_load((REPO / "recipes/llama-debug.yaml").read_text())
    cfg[section][typo] = cfg[section].pop(key)
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as exit_info:
        _fit(monkeypatch, tmp_path, config=recipe)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    # e.g. "error: Group 'data' does not accept option 'global_batchsize'" (jsonargparse words it per section)
    assert error.startswith("error: ") and "does not accept option" in error and f"{typo}'" in error, error


# ---------------------------------------------------------------------------------------- the elastic launcher
@pytest.mark.parametrize("option", ["devices", "max_devices"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_the_elastic_launcher_refuses_zero_devices(capsys, option, value):
    from dynatrain.cli import main

    assert main(["fit", f"--elastic.{option}", value]) == 2
    err = capsys.readouterr().err
    assert f"--elastic.{option} must be at least 1, got {value}: a job cannot run on no device" in err


# ------------------------------------------------------------------------------------------------- registration
def test_a_joiner_with_another_model_config_or_code_version_is_refused_at_registration():
    import torch.distributed as dist

    from dynatrain.elastic.manager import member_info
    from dynatrain.elastic.registry import RegistrationError, register, registered

    store = dist.HashStore()
    register(store, "000000-0", member_info(DEBUG, "0.1.0"))
    register(store, "000001-7", member_info(DEBUG, "0.1.0"))  # the same model and code: accepted
    other_model = member_info(DEBUG.with_overrides(n_layers=2), "0.1.0")
    with pytest.raises(RegistrationError) as err:
        register(store, "000002-8", other_model)
    assert "model_config_hash: job has" in str(err.value) and "code_version" not in str(err.value)
    assert "start it with the job's model config and code version" in str(err.value)
    with pytest.raises(RegistrationError, match="code_version: job has '0.1.0', this process has '0.2.0'"):
        register(store, "000003-9", member_info(DEBUG, "0.2.0"))
    assert sorted(registered(store)) == ["000000-0", "000001-7"]


# ------------------------------------------------------------------------------------------ malformed signal file
def test_a_malformed_signal_file_is_rejected_with_the_fix_and_nothing_is_queued(tmp_path):
    path = tmp_path / "scale.json"
    hub = SignalHub(max_devices=4)
    cases = [
        (b"\xff\xfe{}", "codec can't decode"),
        (b'["devices", 3]', "expected a JSON object"),
        (b'{"devices": 0}', "devices must be at least 1, got 0: a job cannot run on no device"),
        (b'{"devices": 2.5}', "devices must be an integer, got 2.5"),
        (b'{"layout": "tp=3,dp=1"}', "cannot parse 'dp=1'"),
        (b'{"devices": 3}' + b" " * signals.MAX_BODY, f"over {signals.MAX_BODY}"),
    ]
    try:
        FileSource(hub, path, poll_seconds=0.02)
        for i, (data, expected) in enumerate(cases, start=1):
            replace_file(path, data)
            wait_for(lambda: len(hub.rejected) == i)
            reason = hub.rejected[-1].reason
            assert reason.startswith(f"file {path}: ") and expected in reason, reason
            if "file is" not in reason:
                assert '{"devices": 3} or {"layout": "dp_shard=2,tp=2"}' in reason  # says what to write
        replace_file(path, b'{"devices": 5}')  # well formed, beyond the job's limit
        wait_for(lambda: len(hub.rejected) == len(cases) + 1)
        assert "devices=5, above max_devices=4: ask for at most 4" in hub.rejected[-1].reason
        assert hub.poll() is None
    finally:
        hub.close()


# ------------------------------------------------------------------------------------------ control path security
def _request(endpoint: str, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    host, port = endpoint.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _auth(token: str = TOKEN) -> dict:
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}


def test_the_control_server_listens_on_loopback_by_default_and_needs_a_token():
    hub = SignalHub()
    try:
        server = ControlServer(hub, TOKEN)
        assert server.endpoint.startswith("127.0.0.1:")
        with pytest.raises(ValueError, match="needs a non-empty token"):
            ControlServer(hub, "")
        with pytest.raises(ValueError, match="host '192.0.2.7' is not a loopback address: pass allow_remote=True"):
            ControlServer(hub, TOKEN, host="192.0.2.7")
    finally:
        hub.close()


def test_the_token_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = signals.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(signals.hmac, "compare_digest", spy)
    hub = SignalHub()
    try:
        server = ControlServer(hub, TOKEN)
        status, answer = _request(server.endpoint, "POST", "/scale", b'{"devices": 2}', _auth("x" * len(TOKEN)))
        assert status == 403 and "wrong token" in answer["reason"]
        status, _ = _request(server.endpoint, "POST", "/scale", b'{"devices": 2}', _auth())
        assert status == 200
    finally:
        hub.close()
    assert calls == [(b"x" * len(TOKEN), TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]


def test_the_control_endpoint_takes_json_only_and_never_unpickles(tmp_path):
    marker = tmp_path / "unpickled"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payload = pickle.dumps(Exploit())
    hub = SignalHub()
    try:
        server = ControlServer(hub, TOKEN)
        for content_type in ("application/json", "application/octet-stream", "application/python-pickle"):
            status, answer = _request(server.endpoint, "POST", "/scale", payload,
                                      {**_auth(), "Content-Type": content_type})
            assert status == 400 and not answer["accepted"], answer
            expected = "not valid JSON" if content_type == "application/json" else "send application/json"
            assert expected in answer["reason"]
        status, answer = _request(server.endpoint, "POST", "/scale", b'{"devices": 2}',
                                  {**_auth(), "Transfer-Encoding": "chunked"})
        assert status == 411 and "Content-Length" in answer["reason"]
        assert _request(server.endpoint, "GET", "/scale", headers=_auth())[0] == 405
        status, answer = _request(server.endpoint, "POST", "/admin", b'{"devices": 2}', _auth())
        assert status == 404 and "POST /scale" in answer["reason"]
        assert hub.poll() is None
    finally:
        hub.close()
    assert not marker.exists()
    # Nothing in the signal sources can turn received bytes into code or objects other than JSON's.
    source = inspect.getsource(signals)
    for word in ("pickle", "marshal", "shelve", "yaml", "eval(", "exec(", "__import__", "subprocess"):
        assert word not in source, word


def test_a_request_from_a_non_loopback_address_is_refused_before_its_body_is_read(monkeypatch):
    hub = SignalHub()
    try:
        server = ControlServer(hub, TOKEN)
        monkeypatch.setattr(signals, "_peer_host", lambda handler: "198.51.100.4")
        host, port = server.endpoint.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            # A correct token and an announced body that never comes: the answer must not wait for it.
            sock.sendall(f"POST /scale HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode())
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.0 403") and b"loopback only" in answer
        assert hub.poll() is None and "198.51.100.4" in hub.rejected[-1].reason
    finally:
        hub.close()


# ------------------------------------------------------------------------------------ in training, on 2 processes
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_refused_switches_leave_the_state_bitwise_unchanged_and_training_goes_on(tmp_path):
    from _launch import launch

    results = launch("bad_input.py", 2, ["--steps", "3", "--bad-at", "1"], tmp_path, timeout=150)
    expected = {
        "tp_heads": "tp=2 does not divide n_heads=3 of model 'debug': choose a tp that divides 3",
        "product": "dp_shard=4 needs dp_replicate*dp_shard*tp = 4 devices, but there are 2: changing the number "
                   "of processes needs an elastic job",
        "product_tp": "dp_shard=2,tp=2 needs dp_replicate*dp_shard*tp = 4 devices, but there are 2",
        "parse": "cannot parse 'dp=2' in layout 'dp=2': each term is pp=N, dp_replicate=N, dp_shard=N, cp=N, "
                 "tp=N or ep=N",
        "pp_layers": "pp=2 needs at least one layer per stage, and model 'debug' has 1: choose pp <= 1",
        "zero": "tp must be a positive integer, got 0",
        "leave": "leave=[5]: ranks [5] are not in the current world of 2 processes",
        "budget": "less than the largest indivisible piece (one element of 4 bytes): give a budget of at least "
                  "7 bytes",
    }
    for res in results:
        assert res["not_refused"] == [], res
        assert sorted(res["errors"]) == sorted(expected)
        for what, text in expected.items():
            assert text in res["errors"][what], (what, res["errors"][what])
        assert res["states"] > 0 and res["changed"] == [], res["changed"]
        assert res["changed_by_refused_plan"] == [], res["changed_by_refused_plan"]
        assert res["layout"] == "dp_shard=2" and res["reports"] == 0 and res["accumulation"] == 2
        assert res["global_step"] == 3 and len(res["losses"]) == 3 and res["finite"]
        assert res["consumed_samples"] == 12
    assert results[0]["losses"] == results[1]["losses"]
