"""The recipes parse, and `dynatrain fit` trains the debug recipe end to end through Lightning's own launcher."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dynatrain.cli.train import run_lightning_cli

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_parses(recipe, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["dynatrain"])
    with pytest.raises(SystemExit) as exit_info:
        run_lightning_cli(["fit", "--config", str(recipe), "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "dynatrain.DynaTrainStrategy" in out and "model:" in out


def test_recipes_exist_and_the_readme_lists_each_of_them():
    assert {r.stem for r in RECIPES} >= {"llama-debug", "llama-125m", "llama-1b", "llama3-8b", "llama3-70b"}
    readme = (REPO / "README.md").read_text()
    listed = set(re.findall(r"--config recipes/([\w.-]+)\.yaml", readme))
    assert listed == {r.stem for r in RECIPES}, f"README lists {sorted(listed)}, recipes/ has {[r.stem for r in RECIPES]}"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dynatrain_fit_debug_recipe(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "dynatrain.cli", "fit", "--config", str(REPO / "recipes/llama-debug.yaml"),
        "--trainer.max_steps", "10", "--trainer.val_check_interval", "10", "--trainer.limit_val_batches", "2",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "loss: first step" in out
    first, last = (float(x) for x in out.split("loss: first step ")[1].split(" over")[0].split(" -> last step "))
    assert last < first
    # The recipe's run directory is relative to where the command runs.
    assert list((tmp_path / "runs/llama-debug/csv").rglob("metrics.csv")), out[-2000:]
    assert list((tmp_path / "runs/llama-debug/wandb").glob("offline-run-*/run-*.wandb")), out[-2000:]
