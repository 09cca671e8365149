"""The analytic layout of `vps.rules` equals what TP + FSDP2 really place (4 gloo ranks, 7 layouts)."""

from __future__ import annotations

import pytest

from _launch import launch

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(300)
def test_analytic_boxes_equal_dtensor_placements(tmp_path):
    results = launch("vps_layout_check.py", 4, [], tmp_path, timeout=280)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:20])
    # 39 parameters of the debug model, 12 of the tiny one, each with two Adam moments, on every rank.
    per_case = {(name, layout): n for name, layout, n, _, _ in results[0]["checked"]}
    assert len(per_case) == 7
    assert all(n == 3 * (39 if name == "debug" else 12) for (name, _), n in per_case.items())
    # The uneven model really leaves some rank an empty shard (ffn_dim 6 over dp_shard 4).
    assert sum(empty for r in results for _, _, _, empty, _ in r["checked"]) > 0
