"""`dynatrain selfcheck` with world changes: ranks leave, new processes join, every switch equals the DCP oracle."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SEQUENCE = "dp_shard=4 > dp_shard=2 > dp_shard=3 > dp_shard=2,tp=2"


def test_selfcheck_scales_in_and_out_against_the_dcp_oracle():
    # No --devices: the first layout's product (4) is the initial world; the two scale-outs need 2 new processes.
    cmd = [sys.executable, "-m", "dynatrain.cli", "selfcheck", "--model", "debug", "--n-layers", "2",
           "--switches", SEQUENCE, "--steps-between", "2", "--json", "--timeout", "240"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4 and result["joiners"] == 2
    # lcm of the data-parallel sizes 4, 2, 3, 2 times the micro-batch of 2
    assert result["global_batch"] == 24
    switches = result["switches"]
    assert [(s["from"], s["to"], s["world_from"], s["world_to"]) for s in switches] == [
        ("dp_shard=4", "dp_shard=2", 4, 2), ("dp_shard=2", "dp_shard=3", 2, 3),
        ("dp_shard=3", "dp_shard=2,tp=2", 3, 4)]
    assert all(s["bitwise_equal"] is True and s["step_after_equal"] is True for s in switches)
    # The whole new world loaded the oracle's checkpoint, the joiner of each scale-out included.
    assert [s["compared_on"] for s in switches] == [2, 3, 4]
    assert all(s["bytes_moved"] > 0 and s["peak_bytes"] > 0 for s in switches)
    assert result["loss_max_rel_diff"] <= 1e-5
    assert len(result["losses"]) == len(result["static_losses"]) == 8
