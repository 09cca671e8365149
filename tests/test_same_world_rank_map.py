"""``rank_map="auto"`` within one world: the fewest-bytes arrangement of the processes, unless the bytes it saves
cost less wire time than building the target again for it, the default arrangement's build being there already."""

from dynatrain.models.configs import get_model_config
from dynatrain.models.specs import model_states
from dynatrain.switch.in_world import InWorldInputs, plan_in_world
from dynatrain.vps.parallel_config import ParallelConfig
from dynatrain.vps.rules import rule_sharding

OLD, NEW = ParallelConfig.parse("tp=4"), ParallelConfig.parse("dp_shard=2,tp=2")
DEFAULT = [0, 1, 2, 3]


def _inputs(rank_map: str, costs=None) -> InWorldInputs:
    specs = model_states(get_model_config("debug").with_overrides(n_layers=2))
    return InWorldInputs(specs, tuple(rule_sharding(s.rule, OLD) for s in specs),
                         tuple(rule_sharding(s.rule, NEW) for s in specs), OLD, tuple(DEFAULT), NEW, rank_map,
                         64 << 20, costs)


def test_auto_keeps_the_built_arrangement_only_while_the_bytes_it_costs_are_cheaper_than_a_build():
    fewest, _ = plan_in_world(_inputs("optimal"))
    default, _ = plan_in_world(_inputs("identity"))
    assert list(fewest.new.rank_map) != DEFAULT and list(default.new.rank_map) == DEFAULT
    extra = default.bytes_moved - fewest.bytes_moved
    assert extra > 0
    # Nothing measured yet (no build kept, or no switch to time the wire by): the fewest bytes.
    assert plan_in_world(_inputs("auto"))[0].bytes_moved == fewest.bytes_moved
    # One second per GiB: the extra bytes take less than the 0.3 s build, more than a 1 ms one.
    per_byte = 1.0 / 2**30
    assert extra * per_byte < 0.3
    cheap_build, slow_build = plan_in_world(_inputs("auto", (1e-3, per_byte)))[0], \
        plan_in_world(_inputs("auto", (0.3, per_byte)))[0]
    assert list(cheap_build.new.rank_map) == list(fewest.new.rank_map)
    assert list(slow_build.new.rank_map) == DEFAULT and slow_build.bytes_moved == default.bytes_moved
