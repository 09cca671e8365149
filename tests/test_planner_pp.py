"""Pipeline parallelism in the planners: the analytic pp layouts (each state held by one stage), switches that change
pp (every byte delivered once, bytes on the wire = bytes whose owner changes), the 1F1B stage loads and
`dynatrain plan` with pp (the layout policy's pp terms: tests/test_policy_pp.py). Pure Python: no process group."""

from __future__ import annotations

import json

import pytest

from _planner_check import execute
from dynatrain.cli import plan as plan_cli
from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.models.specs import layout_for_model
from dynatrain.models.stage_split import stage_split
from dynatrain.planner import plan_switch
from dynatrain.planner.pipeline_cost import in_flight, stage_loads
from dynatrain.vps import Layout, ParallelConfig

P = ParallelConfig.parse
DEBUG = MODEL_CONFIGS["debug"]  # 4 layers


def _stage_of_positions(layout: Layout, name: str) -> set[int]:
    """The pp coordinates of the positions that hold any of state ``name``."""
    cfg = layout.config
    held = layout.classes[layout.state_class[layout.state_index(name)]]
    return {cfg.stage_of(q) for q, shards in enumerate(held) if shards.boxes}


def _covered_once_per_stage_position(layout: Layout, name: str) -> None:
    """The holding stage's positions hold the whole state, each element once per dp_replicate copy."""
    cfg = layout.config
    spec = layout.state(name)
    held = layout.classes[layout.state_class[layout.state_index(name)]]
    total = sum(shards.numel for shards in held)
    assert total == spec.numel * cfg.dp_replicate * (cfg.tp if spec.tp_dim is None else 1)


# ------------------------------------------------------------------------------------------- analytic layouts
@pytest.mark.parametrize("layout,v", [("pp=2,dp_shard=2,tp=2", 1), ("pp=4,dp_replicate=2", 1),
                                      ("pp=3,dp_shard=3", 1), ("pp=2,dp_shard=2", 2)])
def test_every_state_is_held_by_exactly_one_stage(layout, v):
    cfg = P(layout)
    lay = layout_for_model(DEBUG, cfg, stages_per_rank=v)
    assert lay.world_size == cfg.pp * cfg.stage_size and lay.config == cfg
    split = stage_split(DEBUG, cfg.pp * v)
    last = (cfg.pp * v - 1) % cfg.pp
    for spec in lay.states:
        stages = _stage_of_positions(lay, spec.name)
        assert len(stages) == 1, (spec.name, stages)
        (stage,) = stages
        if spec.name.startswith("tok_embeddings."):
            assert stage == 0
        elif spec.name.startswith(("norm.", "output.")):
            assert stage == last
        else:
            layer = int(spec.name.split(".")[1])
            owner = next(j for j, (lo, hi) in enumerate(split) if lo <= layer < hi)
            assert stage == owner % cfg.pp  # looped placement: stage j on pp rank j % pp
        _covered_once_per_stage_position(lay, spec.name)
    # Every stage holds something, and a position of another stage holds an empty (0, ...) tensor.
    for k in range(cfg.pp):
        q = k * cfg.stage_size
        assert lay.held_bytes(q) > 0
    emb = lay.shards("tok_embeddings.weight", cfg.stage_size * (cfg.pp - 1))
    assert emb.boxes == () and emb.local_shape == (0, 0)


def test_the_fast_pp_layout_equals_the_one_built_from_its_placements():
    for layout in ("pp=2,dp_shard=2,tp=2", "pp=4,dp_replicate=2", "pp=3,dp_shard=3,tp=1"):
        cfg = P(layout)
        fast = layout_for_model(DEBUG, cfg, kind="bf16-adam", rank_map=list(range(cfg.world_size))[::-1])
        slow = Layout.from_shardings(fast.states, fast.shardings, cfg, fast.rank_map)
        for i in range(len(fast.states)):
            assert fast.classes[fast.state_class[i]] == slow.classes[slow.state_class[i]], fast.states[i].name
        assert fast.shardings[0].held == (0, (0,))  # the embedding, on stage 0 of the pp mesh dimension
        assert fast.needed_bytes == slow.needed_bytes


def test_a_pp_layout_without_pp_is_the_plain_one():
    plain = layout_for_model(DEBUG, P("dp_shard=2,tp=2"), stages_per_rank=3)  # one stage whatever v says
    assert plain.classes == layout_for_model(DEBUG, P("dp_shard=2,tp=2")).classes and plain.shardings is None


def test_too_many_stages_and_experts_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match=r"pp=2 x stages_per_rank=3 = 6 pipeline stages .* has 4: choose pp x "
                                         r"stages_per_rank <= 4"):
        layout_for_model(DEBUG, P("pp=2,dp_shard=2"), stages_per_rank=3)
    with pytest.raises(ValueError, match="choose pp <= 4"):
        layout_for_model(DEBUG, P("pp=8"))
    with pytest.raises(ValueError, match="stages_per_rank must be a positive integer"):
        layout_for_model(DEBUG, P("pp=2"), stages_per_rank=0)
    # A mixture of experts too: its stages need a layer each (moe-debug has 2).
    with pytest.raises(ValueError, match=r"pp=2 x stages_per_rank=2 = 4 pipeline stages .* has 2"):
        layout_for_model("moe-debug", P("pp=2,dp_shard=2,ep=2"), stages_per_rank=2)
    # A pp shape alone does not say which layers a stage holds: the planner wants the Layout.
    with pytest.raises(ValueError, match="pass the target as a Layout"):
        plan_switch(layout_for_model(DEBUG, P("dp_shard=4")), "pp=2,dp_shard=2")


# ------------------------------------------------------------------------------------------- switches
def _bytes_whose_owner_changes(plan) -> int:
    """Independently of routing: per state and new position, the bytes its process needs less those it held."""
    old, new = plan.old, plan.new
    moved = 0
    for spec in new.states:
        for q, proc in enumerate(new.rank_map):
            need = new.shards(spec.name, proc).boxes
            have = old.boxes(spec.name, proc)
            kept = sum(b.intersect(h).numel for b in need for h in have if b.intersect(h) is not None)
            moved += (sum(b.numel for b in need) - kept) * spec.itemsize
    return moved


SWITCHES = [
    ("dp_shard=4,tp=2", "pp=2,dp_shard=2,tp=2"),      # pp 1 -> 2
    ("pp=2,dp_shard=2,tp=2", "pp=4,dp_shard=2"),      # pp 2 -> 4, tp off
    ("pp=4,dp_shard=2", "dp_shard=4,tp=2"),           # pp 4 -> 1, tp on
    ("pp=2,dp_replicate=2,dp_shard=2", "pp=4,tp=2"),  # HSDP replicas to more stages
    ("pp=3,dp_shard=2", "pp=2,dp_shard=3"),           # uneven splits on both sides
]


@pytest.mark.parametrize("old,new", SWITCHES)
@pytest.mark.parametrize("gpus_per_node", [None, 2])
def test_pp_switches_deliver_every_byte_once_and_move_only_what_changes_owner(old, new, gpus_per_node):
    a, b = layout_for_model(DEBUG, P(old)), layout_for_model(DEBUG, P(new))
    plan = plan_switch(a, b, budget_bytes=1 << 17, gpus_per_node=gpus_per_node)
    execute(plan)  # exact cover, values, budget, alloc/free order, sender and receiver agree
    assert plan.bytes_moved == _bytes_whose_owner_changes(plan)
    assert plan.bytes_moved <= plan.bytes_moved_identity
    if gpus_per_node is not None:
        tp = P(new).tp
        rm = plan.new.rank_map
        assert all(len({p // gpus_per_node for p in rm[g:g + tp]}) == 1 for g in range(0, len(rm), tp))


def test_interleaved_stages_and_a_scale_in_across_a_pp_change():
    # Two stages per pp rank (4 stages of one layer, stage j on pp rank j % 2) -> 3 plain stages on 6 of the 8.
    a = layout_for_model(DEBUG, P("pp=2,dp_shard=4"), stages_per_rank=2)
    assert {k for k in range(2) if a.shards("layers.0.attention.wq.weight", 4 * k).boxes} == {0}
    assert {k for k in range(2) if a.shards("layers.1.attention.wq.weight", 4 * k).boxes} == {1}
    assert {k for k in range(2) if a.shards("layers.2.attention.wq.weight", 4 * k).boxes} == {0}
    b = layout_for_model(DEBUG, P("pp=3,dp_shard=2"))
    plan = plan_switch(a, b, leave=[7, 3], budget_bytes=1 << 16)
    execute(plan)
    assert not {3, 7} & set(plan.new.processes) and len(plan.new.processes) == 6
    assert plan.bytes_moved == _bytes_whose_owner_changes(plan)


def test_moving_whole_stages_keeps_what_stays_on_its_stage():
    # Same stage size, pp 2 -> 4: with the optimal map every process keeps the quarter of the layers it still
    # holds; the identity map puts stage 1's processes on stage 2's layers too, so it cannot keep more.
    a, b = layout_for_model(DEBUG, P("pp=2,dp_shard=2")), layout_for_model(DEBUG, P("pp=4"))
    plan = plan_switch(a, b, budget_bytes=1 << 20)
    assert 0 < plan.bytes_moved < plan.bytes_total
    assert plan.bytes_moved == _bytes_whose_owner_changes(plan) <= plan.bytes_moved_identity


def test_stage_loads_and_1f1b_in_flight():
    loads = stage_loads(stage_split(MODEL_CONFIGS["llama3-70b"], 4), 4)
    assert sum(x.layers for x in loads) == 80 and loads[0].first and loads[-1].last
    assert [in_flight(4, k, 16) for k in range(4)] == [4, 3, 2, 1] and in_flight(4, 0, 2) == 2
    interleaved = stage_loads(stage_split(MODEL_CONFIGS["llama3-70b"], 8), 4)
    assert interleaved[3].last and not interleaved[0].last and sum(x.layers for x in interleaved) == 80


# ------------------------------------------------------------------------------------------- dynatrain plan
def _json(capsys, *argv):
    assert plan_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_cli_with_pp(capsys):
    out = _json(capsys, "--model", "llama3-70b", "--from", "dp_shard=16,tp=8", "--to", "pp=2,dp_shard=8,tp=8",
                "--gpus-per-node", "8")
    assert out["to"] == "pp=2,dp_shard=8,tp=8" and out["processes_new"] == 128 and out["stages_per_rank"] == 1
    # Each process keeps its 1/16 of the layers its new stage holds: half of what its new 1/8 share needs.
    assert out["fraction_moved"] == pytest.approx(0.5, abs=0.01)
    assert out["bytes_moved"] < out["bytes_moved_identity"] and out["predicted_seconds"] > 0
    back = _json(capsys, "--model", "debug", "--from", "pp=2,dp_shard=2", "--to", "pp=4", "--stages-per-rank", "1",
                 "--budget-mb", "1")
    assert back["from"] == "pp=2,dp_shard=2" and back["processes_old"] == 4
    text_ok = plan_cli.main(["--model", "debug", "--from", "pp=2,dp_shard=2", "--to", "dp_shard=2,tp=2",
                             "--stages-per-rank", "2"])
    assert text_ok == 0 and "2 pipeline stage(s) per pp rank" in capsys.readouterr().out


def test_plan_cli_refuses_too_many_stages_without_a_traceback(capsys):
    assert plan_cli.main(["--model", "debug", "--from", "pp=2,dp_shard=2", "--to", "pp=4",
                          "--stages-per-rank", "2"]) == 2
    err = capsys.readouterr().err
    assert "choose pp x stages_per_rank <= 4" in err and "Traceback" not in err
    assert plan_cli.main(["--model", "debug", "--from", "dp_shard=2", "--to", "pp=8"]) == 2
    assert "choose pp <= 4" in capsys.readouterr().err
    assert plan_cli.main(["--model", "moe-debug", "--from", "dp_shard=4,ep=4", "--to", "pp=4"]) == 2
    assert "choose pp <= 2" in capsys.readouterr().err
