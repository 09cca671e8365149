"""The model registry (`models.registry`) is the one place a config's type decides anything: every kind round-trips
from its config to its spec and to the analytic state specs the per-kind code gives, an unknown config type is
refused with the known kinds named, and no module outside `dynatrain/models/` checks the kind itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dynatrain.models.configs import MODEL_CONFIGS, ModelConfig
from dynatrain.models.moe_configs import MOE_CONFIGS, MoEConfig
from dynatrain.models.moe_specs import expert_sharding, is_routed_expert
from dynatrain.models.registry import ModelSpec, get_zoo_config, kinds, register, spec_for, zoo_names
from dynatrain.models.specs import layout_for_model, model_states
from dynatrain.models.tp_styles import moe_tp_shard_dim, tp_shard_dim
from dynatrain.policy import Workload
from dynatrain.policy.sizes import ModelSizes, model_sizes
from dynatrain.policy.step_model import recompute_fraction
from dynatrain.vps.layout import STATE_KINDS, Layout, StateSpec
from dynatrain.vps.parallel_config import ParallelConfig
from dynatrain.vps.rules import ShardRule, rule_sharding

PACKAGE = Path(__file__).resolve().parents[1] / "dynatrain"
DEBUG, MOE_DEBUG = MODEL_CONFIGS["debug"], MOE_CONFIGS["moe-debug"]


def _dense_states(cfg: ModelConfig, kind: str) -> tuple[StateSpec, ...]:
    """Every state of a dense model as `apply_tp` + `apply_fsdp` split it, written out from the TP table."""
    out = []
    for name, shape in cfg.param_shapes().items():
        rule = ShardRule(shape, tp_shard_dim(name))
        out += [StateSpec(name + suffix, shape, dtype, rule.tp_dim, rule.fused) for suffix, dtype in STATE_KINDS[kind]]
    return tuple(out)


def _moe_states(cfg: MoEConfig, kind: str) -> tuple[StateSpec, ...]:
    """Every state of a MoE model: routed experts whole on every TP rank, the rest by the MoE TP table."""
    out = []
    for name, shape in cfg.param_shapes().items():
        tp_dim = None if is_routed_expert(name) else moe_tp_shard_dim(name)
        out += [StateSpec(name + suffix, shape, dtype, tp_dim) for suffix, dtype in STATE_KINDS[kind]]
    return tuple(out)


def _moe_layout(cfg: MoEConfig, pcfg: ParallelConfig, kind: str) -> Layout:
    shardings = [expert_sharding(pcfg) if is_routed_expert(name)
                 else rule_sharding(ShardRule((1, 1), moe_tp_shard_dim(name)), pcfg)
                 for name in cfg.param_shapes() for _ in STATE_KINDS[kind]]
    return Layout.from_shardings(_moe_states(cfg, kind), shardings, pcfg)


def _placed(layout: Layout) -> tuple:
    """What a layout says, class numbering aside: its states and every process's boxes of each."""
    boxes = {(s.name, p): layout.boxes(s.name, p) for s in layout.states for p in layout.processes}
    return layout.states, layout.config, boxes


def test_the_built_in_kinds_are_registered_once_each():
    assert [(s.name, s.config_type) for s in kinds()] == [("dense", ModelConfig), ("moe", MoEConfig)]
    assert zoo_names() == sorted(MODEL_CONFIGS) + sorted(MOE_CONFIGS)
    for spec in kinds():
        for name, cfg in spec.configs.items():
            assert get_zoo_config(name) is cfg and spec_for(cfg) is spec


@pytest.mark.parametrize("kind", sorted(STATE_KINDS))
@pytest.mark.parametrize("cfg,expected", [(DEBUG, _dense_states), (MOE_DEBUG, _moe_states)], ids=["dense", "moe"])
def test_every_kind_round_trips_to_its_analytic_states(cfg, expected, kind):
    spec = spec_for(cfg)
    assert spec.states(cfg, kind) == expected(cfg, kind) == model_states(cfg.name, kind)


@pytest.mark.parametrize("layout", ["dp_shard=4", "dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2"])
def test_a_dense_layout_without_pp_follows_from_its_config(layout):
    pcfg = ParallelConfig.parse(layout)
    spec = spec_for(DEBUG)
    assert spec.placed_by_rules
    expected = Layout.from_config(_dense_states(DEBUG, "fp32-adam"), pcfg)
    assert _placed(spec.layout(DEBUG, pcfg, "fp32-adam", None, 1)) == _placed(expected)
    assert _placed(layout_for_model("debug", pcfg)) == _placed(expected)


@pytest.mark.parametrize("layout", ["dp_shard=4", "dp_shard=4,ep=2", "dp_shard=2,tp=2,ep=2",
                                    "dp_replicate=2,dp_shard=4,ep=2"])
def test_a_moe_layout_places_routed_experts_over_ep(layout):
    pcfg = ParallelConfig.parse(layout)
    spec = spec_for(MOE_DEBUG)
    assert not spec.placed_by_rules
    expected = _moe_layout(MOE_DEBUG, pcfg, "fp32-adam")
    assert _placed(spec.layout(MOE_DEBUG, pcfg, "fp32-adam", None, 1)) == _placed(expected)
    assert _placed(layout_for_model("moe-debug", pcfg)) == _placed(expected)


def test_both_kinds_split_into_pipeline_stages_and_a_kind_without_a_split_is_refused_pp():
    import dataclasses

    dense, moe = spec_for(DEBUG), spec_for(MOE_DEBUG)
    assert dense.pipeline and dense.stages(DEBUG, 2) == ((0, 2), (2, 4))
    assert moe.pipeline and moe.stages(MOE_DEBUG, 2) == ((0, 1), (1, 2))
    unsplit = dataclasses.replace(moe, stage_split=None)
    assert not unsplit.pipeline
    with pytest.raises(ValueError, match="not supported for mixture-of-experts models yet: use pp=1"):
        unsplit.stages(MOE_DEBUG, 2)


def test_the_policy_terms_of_the_debug_configs_keep_their_figures():
    # Figures of the cost model as it stood when each kind was priced by its own branch; they must not move.
    figures = {
        "debug": (ModelSizes(1706240, 393728, 131328, 3279104, embedding=65536), (11264.0, 768.0), 2448.0, 0.375,
                  256),
        "moe-debug": (ModelSizes(215680, 75008, 65664, 264832, 786432, 393216, 196608, 32768), (10304.0, 384.0),
                      5152.0, 0.5, 128),
    }
    for name, (sizes, layer, saved, fraction, width) in figures.items():
        work = Workload(name, seq_len=256, global_batch=32, sequence_parallel=True, fused_attention=False)
        spec = spec_for(work.model)
        assert model_sizes(work.model, 2) == sizes
        assert spec.layer_bytes(work.model, work, 2) == layer
        assert spec.op_saved_bytes(work.model, work, 2, layer[0]) == saved
        assert recompute_fraction(work.with_checkpointing("selective:op")) == fraction
        assert spec.attention_width(work.model) == width


@pytest.mark.parametrize("cfg", [DEBUG, MOE_DEBUG], ids=["dense", "moe"])
def test_every_kind_builds_its_module_with_the_configs_shapes(cfg):
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        module = spec_for(cfg).build(cfg)
    assert {n: tuple(p.shape) for n, p in module.named_parameters()} == cfg.param_shapes()


def test_an_unknown_config_type_names_the_known_kinds():
    class GPTConfig:
        pass

    with pytest.raises(ValueError, match=r"no model kind is registered for a GPTConfig: the known kinds are "
                                         r"dense \(ModelConfig\), moe \(MoEConfig\); register a ModelSpec"):
        spec_for(GPTConfig())
    with pytest.raises(ValueError, match=r"unknown model 'gpt5'; choose a dense one \(debug.* or a mixture of "
                                         r"experts \(moe-debug"):
        get_zoo_config("gpt5")


def test_a_kind_is_registered_once():
    dense = spec_for(DEBUG)
    with pytest.raises(ValueError, match="ModelConfig is already the config of kind 'dense'"):
        register(dense)
    assert isinstance(dense, ModelSpec)


# ---- no kind check outside models/ ------------------------------------------------------------------------
KIND_TYPES = {spec.config_type.__name__ for spec in kinds()}


def kind_checks(source: str) -> list[str]:
    """Where ``source`` decides on a model's kind itself: isinstance/issubclass or a comparison against a
    registered config type, an ``is_moe`` name, or MoEConfig imported (construction goes through the registry)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance",
                                                                                               "issubclass"):
            tested = node.args[1:]
        elif isinstance(node, ast.Compare):
            tested = [node.left, *node.comparators]
        else:
            tested = []
        named = {n.id for t in tested for n in ast.walk(t) if isinstance(n, ast.Name)}
        named |= {n.attr for t in tested for n in ast.walk(t) if isinstance(n, ast.Attribute)}
        if named & KIND_TYPES:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if (isinstance(node, ast.Name) and node.id == "is_moe") or (isinstance(node, ast.Attribute)
                                                                    and node.attr == "is_moe"):
            found.append(f"line {node.lineno}: is_moe")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "is_moe":
            found.append(f"line {node.lineno}: def is_moe")
        if isinstance(node, ast.ImportFrom) and any(a.name == "MoEConfig" for a in node.names):
            found.append(f"line {node.lineno}: imports MoEConfig")
    return found


def test_the_scan_finds_each_kind_check():
    for snippet in ("isinstance(cfg, MoEConfig)", "isinstance(cfg, (ModelConfig, int))", "type(cfg) is MoEConfig",
                    "issubclass(t, moe_configs.MoEConfig)", "x = self.is_moe", "def is_moe(c): pass",
                    "from dynatrain.models.moe_configs import MoEConfig"):
        assert kind_checks(snippet), snippet
    assert not kind_checks("spec = spec_for(cfg)\nif spec.routed_experts: pass\nisinstance(x, int)")


def test_no_module_outside_models_checks_the_kind_itself():
    checks = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        if rel.parts[1] != "models":
            checks.update({f"{rel} {c}": None for c in kind_checks(path.read_text())})
    assert not checks, "ask models.registry.spec_for(config) instead: " + ", ".join(checks)
