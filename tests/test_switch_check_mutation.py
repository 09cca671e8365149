"""The switch's check trusts nothing it verifies: an engine that writes exactly where its plan says, the plan made
from a wrong rank map, is caught and the moved states named; the real plan passes the same check."""

import pytest
from _launch import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_a_transfer_planned_from_a_wrong_rank_map_is_caught_and_named(tmp_path):
    wrong = launch("mutation.py", 4, ["--wrong"], tmp_path / "wrong")
    for res in wrong:
        assert res["verify_default"] is True  # on by default
        error = res["outcome"]["error"]
        assert "dp_shard=2,tp=2 -> dp_shard=4 changed" in error
        # a weight, sharded differently at positions 0 and 1, is named with why
        assert "values differ" in error and "weight" in error
    assert len({res["outcome"]["error"] for res in wrong}) == 1  # every rank names the same states


def test_one_flipped_byte_of_a_received_piece_is_caught_and_named(tmp_path):
    corrupt = launch("mutation.py", 4, ["--corrupt"], tmp_path / "corrupt")
    for res in corrupt:
        error = res["outcome"]["error"]
        assert "changed 1 state(s)" in error and "wq.weight: values differ" in error, error
    assert len({res["outcome"]["error"] for res in corrupt}) == 1


def test_the_real_plan_passes_the_same_check(tmp_path):
    right = launch("mutation.py", 4, [], tmp_path / "right")
    for res in right:
        assert res["outcome"]["verified"] is True
        assert res["outcome"]["phases"]["verify"] > 0
