"""`dynatrain selfcheck --chaos SEED [--inject]`: random switches over every term, world changes and a process death
included, against the run without switches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _launch import python_path
from dynatrain.models.specs import get_zoo_config
from dynatrain.selfcheck.chaos import draw, survivors_of, terms_used

DEBUG = get_zoo_config("debug")
MOE = get_zoo_config("moe-debug")


@pytest.mark.parametrize("seed", range(20))
def test_a_draw_is_reproducible_valid_and_spans_three_terms(seed):
    chaos = draw(seed, 8, DEBUG, deaths=1)
    assert chaos == draw(seed, 8, DEBUG, deaths=1)
    layouts = chaos.layouts
    assert len(layouts) == 9 and len(terms_used(layouts)) >= 3
    for a, b in zip(layouts, layouts[1:]):
        assert a != b
        b.validate(DEBUG, b.world_size)
    death = chaos.death
    assert 1 <= death < 8
    before, after = layouts[death], layouts[death + 1]
    assert before.dp_replicate >= 2 and before.pp == 1  # every shard on two processes: rebuilt in memory
    assert after == survivors_of(before, DEBUG) and after.world_size == before.world_size - 1


def test_draws_cover_every_term_the_model_has_and_change_the_world_both_ways():
    dense = [draw(seed, 8, DEBUG) for seed in range(30)]
    assert set().union(*(terms_used(c.layouts) for c in dense)) == {"dp_replicate", "dp_shard", "tp", "pp"}
    moe = [draw(seed, 8, MOE, terms=("dp_replicate", "dp_shard", "tp", "ep")) for seed in range(30)]
    assert "ep" in set().union(*(terms_used(c.layouts) for c in moe))
    steps = [(a.world_size, b.world_size) for c in dense for a, b in zip(c.layouts, c.layouts[1:])]
    assert any(a < b for a, b in steps) and any(a > b for a, b in steps)


def test_a_request_the_model_cannot_serve_is_named():
    with pytest.raises(ValueError, match="dp_replicate >= 2"):
        draw(0, 8, DEBUG, max_devices=4, terms=("dp_shard", "tp"), deaths=1)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_seeded_chaos_run_with_a_death_trains_as_without_switches():
    env = dict(os.environ, PYTHONPATH=python_path(Path(__file__).resolve().parent.parent))
    cmd = [sys.executable, "-m", "dynatrain.cli", "selfcheck", "--chaos", "1", "--inject", "--n-layers", "4",
           "--steps-between", "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=560, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "selfcheck --chaos 1 --inject: --switches" in proc.stderr  # the seed and its sequence, to replay
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["chaos"]["seed"] == 1
    switches = result["switches"]
    assert len(switches) == 8 and [s.get("death", False) for s in switches].count(True) == 1
    assert all(s["bitwise_equal"] is True and s["step_after_equal"] is True for s in switches)
    assert len({w for s in switches for w in (s["world_from"], s["world_to"])}) >= 3
    assert result["loss_max_rel_diff"] <= 1e-5 and result["samples_equal"]
    # every step a whole global batch, no sample skipped or read twice within it
    assert all(len(step) == result["global_batch"] == len(set(step)) for step in result["samples"])
