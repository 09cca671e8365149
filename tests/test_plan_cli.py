from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynatrain.cli import plan as plan_cli

REPO = Path(__file__).resolve().parent.parent
KEYS = {"bytes_total", "bytes_moved", "bytes_moved_identity", "rounds", "max_rank_bytes", "predicted_seconds",
        "plan_seconds", "peak_staging_bytes"}


def _json(capsys, *argv):
    assert plan_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_for_the_70b_scale_in(capsys):
    out = _json(capsys, "--model", "llama3-70b", "--from", "dp_shard=128", "--to", "dp_shard=64")
    assert KEYS <= set(out)
    assert out["bytes_moved"] * 2 == out["bytes_total"]
    assert out["bytes_moved_identity"] * 128 == out["bytes_total"] * 127
    assert out["rounds"] >= 1 and out["peak_staging_bytes"] <= out["budget_bytes"] == 2048 << 20
    assert 0 < out["predicted_seconds"] < 1 and out["plan_seconds"] > 0
    assert len(out["leaving"]) == 64


def test_options_change_the_plan(capsys):
    base = ["--model", "debug", "--from", "dp_shard=4,tp=2", "--to", "dp_shard=2,tp=2"]
    ident = _json(capsys, *base, "--rank-map", "identity")
    best = _json(capsys, *base)
    assert best["bytes_moved"] <= ident["bytes_moved"] == best["bytes_moved_identity"]
    small = _json(capsys, *base, "--budget-mb", "0.25", "--leave", "1,6", "--gpus-per-node", "4")
    assert small["rounds"] > best["rounds"] and small["peak_staging_bytes"] <= 1 << 18
    assert {1, 6} <= set(small["leaving"])
    mixed = _json(capsys, *base, "--state", "bf16-adam")
    assert mixed["bytes_total"] * 12 == best["bytes_total"] * 14
    slow = _json(capsys, *base, "--link-gbps", "10", "--intra-node-gbps", "10")
    assert slow["predicted_seconds"] > best["predicted_seconds"]


def test_text_output_names_every_figure(capsys):
    assert plan_cli.main(["--model", "debug", "--from", "dp_shard=4", "--to", "dp_shard=3"]) == 0
    text = capsys.readouterr().out
    for label in ("bytes total", "bytes moved", "identity map", "largest per-rank send", "rounds",
                  "peak staging", "predicted transfer", "planning"):
        assert label in text


def test_bad_input_says_what_to_change(capsys):
    assert plan_cli.main(["--model", "debug", "--from", "dp_shard=2", "--to", "tp=3"]) == 2
    assert "tp=3 does not divide" in capsys.readouterr().err
    assert plan_cli.main(["--model", "debug", "--from", "dp_shard=2", "--to", "dp_shard=4",
                          "--budget-mb", "0.000001"]) == 2
    assert "at least 7 bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_cli.main(["--model", "debug", "--from", "dp_shard=two", "--to", "tp=2"])
    assert "cannot parse" in capsys.readouterr().err


def test_dynatrain_plan_subcommand(capsys):
    from dynatrain.cli import main

    assert main(["plan", "--model", "debug", "--from", "dp_shard=2", "--to", "dp_shard=4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"] == 1


@pytest.mark.timeout(120)
def test_the_console_command_plans_without_importing_torch_or_lightning():
    # What the `dynatrain` console script runs: the package root, the cli package and `plan` only. torch alone
    # costs over a second to import; `dynatrain plan` answers for 1,024 ranks in about that.
    code = ("import sys\n"
            "from dynatrain.cli import main\n"
            "assert main(['plan', '--model', 'debug', '--from', 'dp_shard=2', '--to', 'dp_shard=4', '--json']) == 0\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'lightning_fabric')]\n"
            "assert not heavy, heavy[:10]\n")
    res = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["processes_new"] == 4


@pytest.mark.timeout(120)
def test_module_entry_point():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", "dynatrain.cli.plan", "--model", "1b", "--from", "dp_shard=8",
                          "--to", "dp_shard=4,tp=2", "--json"], env=env, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["processes_new"] == 8


def test_a_mixture_of_experts_switch_is_planned_from_its_analytic_specs(capsys):
    out = _json(capsys, "--model", "qwen3-235b-a22b", "--from", "dp_shard=32,tp=4,ep=16",
                "--to", "dp_shard=64,tp=2,ep=32", "--gpus-per-node", "8")
    assert out["from"] == "dp_shard=32,tp=4,ep=16" and out["to"] == "dp_shard=64,tp=2,ep=32"
    assert 0 < out["bytes_moved"] <= out["bytes_moved_identity"]
    assert out["processes_new"] == 128 and out["rounds"] >= 1
    small = _json(capsys, "--model", "moe-debug", "--from", "dp_shard=4,ep=4", "--to", "dp_shard=2,ep=2",
                  "--leave", "2,3")
    assert small["processes_new"] == 2 and {2, 3} <= set(small["leaving"])


@pytest.mark.parametrize("model,layout,expected", [
    ("qwen3-235b-a22b", "dp_shard=48,ep=24", "ep=24 does not divide n_experts=128"),
    ("llama3-8b", "dp_shard=8,ep=2", "model 'llama3-8b' has none: use ep=1"),
])
def test_an_expert_layout_the_model_cannot_take_is_refused_without_a_traceback(capsys, model, layout, expected):
    assert plan_cli.main(["--model", model, "--from", layout, "--to", "dp_shard=48" if "48" in layout
                          else "dp_shard=8"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
