"""Everything else unchanged for a module with no configure_model() (issue 45 item 4): the stock Hugging Face
Llama of tests/workers (tied embeddings, parallelised by the strategy's default) under `dynatrain selfcheck
--module` against the DCP oracle, a process lost and a snapshot resumed, and the ElasticCallback driving its
switches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import launch_elastic, python_path, selfcheck_module

pytest.importorskip("transformers")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

MODULE = "hf_selfcheck:AutoModule"


def test_selfcheck_module_switches_dp_tp_and_the_world_bitwise_as_the_oracle():
    layouts = ["dp_shard=4", "dp_replicate=2,dp_shard=2", "dp_shard=2,tp=2", "dp_shard=3"]
    result = selfcheck_module(MODULE, layouts)
    assert result["worlds"] == [4, 4, 4, 3] and result["samples_equal"]


def test_a_lost_process_is_recovered_and_a_snapshot_resumed_with_the_committed_state():
    # rank-dies: a member of an HSDP world killed mid-step, the survivors rebuild from the replicas in memory;
    # leaver-dies: the job stops and restarts on the process left from its latest Snapshot, the module's included.
    tests = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=python_path(tests / "workers", tests.parent))
    cmd = [sys.executable, "-m", "dynatrain.cli", "selfcheck", "--module", MODULE, "--inject",
           "rank-dies,leaver-dies", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=560, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    died, left = json.loads(proc.stdout.strip().splitlines()[-1])
    for verdict in (died, left):
        assert verdict["ok"] and verdict["model"] == MODULE, verdict
        assert verdict["recovered"] and verdict["state_equal_to_committed"] is True, verdict
    assert died["steps_lost"] == 0 and died["layout_after"] == "dp_shard=3"
    assert left["steps_lost"] == 1 and left["layout_after"] == "dp_shard=1"  # the snapshot of step 2 of 3


def test_the_elastic_callback_drives_a_tp_switch_and_a_scale_in_by_a_device_count(tmp_path):
    # A device count goes to the layout policy, which cannot price a model of the user's own: the strategy's
    # fallback layout, not a refusal.
    trace = json.dumps([[1, "dp_shard=2,tp=2"], [3, 3]])  # planned ahead: each runs one step later
    members, _ = launch_elastic("hf_data.py", 4, ["--elastic", "--model", "llama", "--steps", "5", "--trace", trace],
                                tmp_path, timeout=400)
    assert sum(m["left"] for m in members) == 1
    for res in (m for m in members if not m["left"]):
        assert [(d["action"], d["target"]) for d in res["decisions"]] == [("switch", "dp_shard=2,tp=2"),
                                                                            ("switch", "dp_shard=3")]
        assert "not priced" in res["decisions"][1]["reason"]
        assert [r["new_layout"] for r in res["reports"]] == ["dp_shard=2,tp=2", "dp_shard=3"]
        assert all(r["verified"] is True for r in res["reports"]) and len(res["losses"]) == 5
