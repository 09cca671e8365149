"""The zoo's mixture-of-experts decoder is an ordinary user of the switch path: a LightningModule parallelises it
in configure_model() (data and tensor parallelism; expert parallelism is not built yet) and it switches online,
stacked experts, router and balancing buffers included."""

from __future__ import annotations

import pytest
from _launch import launch

SEQUENCE = ["dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2", "tp=4", "dp_shard=4"]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_moe_debug_switches_through_every_layout_and_trains_as_without_switches(tmp_path):
    common = ["--layout", "dp_shard=4", "--steps", "5", "--moe"]
    [static, *_] = launch("user_switch.py", 4, common, tmp_path / "static")
    switches = ";".join(f"{i + 1}:{layout}" for i, layout in enumerate(SEQUENCE))
    for res in launch("user_switch.py", 4, [*common, "--switches", switches], tmp_path / "switched"):
        assert [r["new_layout"] for r in res["reports"]] == SEQUENCE
        assert all(r["verified"] is True for r in res["reports"])  # every state bitwise where it was
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(res["losses"], static["losses"]))
        assert len(res["losses"]) == 5
        # the auxiliary-loss-free balancing state moved with the experts: the bias is the static run's
        assert res["expert_bias"] == static["expert_bias"] and any(any(b) for b in res["expert_bias"])
