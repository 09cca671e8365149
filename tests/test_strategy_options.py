"""`DynaTrainStrategy`'s option groups: each takes its dataclass or a dict of its fields, the same either way; a key
that is no field is refused with the valid ones named; a bad value fails when the strategy is made."""

from __future__ import annotations

import pytest

import dynatrain
from dynatrain import DataOptions, ParallelismOptions, SwitchingOptions


def test_a_dict_and_the_dataclass_give_the_same_options():
    by_dict = dynatrain.DynaTrainStrategy(
        parallelism={"activation_checkpointing": "selective:2", "param_dtype": "bfloat16"},
        switching={"switch_budget_mb": 1.5, "rank_map": "identity"}, data={"check_batches": True})
    by_class = dynatrain.DynaTrainStrategy(
        parallelism=ParallelismOptions(activation_checkpointing="selective:2", param_dtype="bfloat16"),
        switching=SwitchingOptions(switch_budget_mb=1.5, rank_map="identity"), data=DataOptions(check_batches=True))
    for s in (by_dict, by_class):
        assert s.parallelism.checkpointing.every == 2 and s.parallelism.mp_policy is not None
        assert s.switching.budget_bytes == int(1.5 * 2**20) and s.switching.rank_map == "identity"
        assert s.data_options.check_batches
    assert by_dict.parallelism == by_class.parallelism and by_dict.switching == by_class.switching


def test_the_defaults():
    s = dynatrain.DynaTrainStrategy()
    assert s.parallelism == ParallelismOptions() and s.parallelism.mp_policy is None
    assert s.switching.verify_switches and s.switching.rank_map == "auto"
    assert not s.data_options.check_batches


@pytest.mark.parametrize("option, field", [("parallelism", "sequence_paralel"), ("switching", "budget"),
                                           ("data", "check_batch")])
def test_an_unknown_key_names_the_valid_ones(option, field):
    with pytest.raises(ValueError, match=rf"{option}: unknown option\(s\) '{field}'; the valid ones are "):
        dynatrain.DynaTrainStrategy(**{option: {field: True}})


def test_bad_values_fail_when_the_strategy_is_made():
    with pytest.raises(ValueError, match="rank_map='closest'"):
        dynatrain.DynaTrainStrategy(switching={"rank_map": "closest"})
    with pytest.raises(ValueError, match="activation_checkpointing"):
        dynatrain.DynaTrainStrategy(parallelism={"activation_checkpointing": "some"})
    with pytest.raises(ValueError, match="Interleaved1F1B"):
        dynatrain.DynaTrainStrategy(parallelism={"pipeline_schedule": "Interleaved1F1B"})
    with pytest.raises(TypeError, match="switching= takes a SwitchingOptions or a dict"):
        dynatrain.DynaTrainStrategy(switching=True)
