"""examples/hf_causal_lm.py, the README's "Bring a model you already have", run as a user runs it (python, and
Lightning's own launcher for the second process) for a few steps with a switch to tp from the model's own plan;
and the README's snippet is the example's code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import python_path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "hf_causal_lm.py"


def test_the_readme_snippet_is_the_examples_code_and_transformers_stays_optional():
    readme = (REPO / "README.md").read_text()
    section = readme.split("### Bring a model you already have", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    lm = re.search(r"^class LM\(pl\.LightningModule\):\n(?:    .*\n)+", snippet, re.M).group(0)
    assert lm in EXAMPLE.read_text()
    pyproject = (REPO / "pyproject.toml").read_text()  # read as text: tomllib is 3.11+, dynatrain runs on 3.10
    runtime = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.M | re.S).group(1)
    dev = re.search(r"^dev = \[(.*?)\]", pyproject, re.M | re.S).group(1)
    assert "transformers" not in runtime and '"transformers' in dev


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_example_trains_on_two_processes_and_switches_to_tp(tmp_path):
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=python_path(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(EXAMPLE), "--devices", "2", "--max-steps", "3", "--relayout", "1:tp=2",
           "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # planned ahead: requested after step 1, run at the end of step 2
    assert "switch at step 2: dp_shard=2 -> tp=2, verified=True" in proc.stdout, proc.stdout[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("trained ")]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", line).groups())
    assert line.startswith("trained 3 steps, now on tp=2")
    # random tokens over 256 ids: about ln(256) = 5.55 before and after, whatever the layout's accumulation
    assert abs(first - 5.55) < 0.2 and abs(last - 5.55) < 0.2, line
    assert (tmp_path / "run" / "control.json").exists()  # the endpoint `dynatrain scale` takes
