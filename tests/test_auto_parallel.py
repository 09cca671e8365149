"""The default parallelisation of a module without configure_model(), run on meta over probe meshes of fake groups
(any layout in one process): which blocks get FSDP2 units, TP from a Hugging Face plan, tied weights kept one, and
the layouts a plan cannot serve refused with the reason."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from dynatrain.models.auto_parallel import AutoOptions, find_blocks, mp_policy_for, parallelize_auto, tied_groups
from dynatrain.models.tp_from_plan import expand, model_plan
from dynatrain.switch.module_copy import meta_copy
from dynatrain.switch.probe import probe_mesh
from dynatrain.vps.parallel_config import ParallelConfig

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from user_model import Block, TinyLM  # noqa: E402


class Holder(nn.Module):
    """A LightningModule's stand-in: the model is a child, as the default parallelisation expects."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def _hf(name: str) -> nn.Module:
    pytest.importorskip("transformers")
    from hf_data import build_model

    return build_model(name)


def _built(model: nn.Module, layout: str, options: AutoOptions = AutoOptions()) -> Holder:
    holder = meta_copy(Holder(model))
    with probe_mesh(ParallelConfig.parse(layout)) as mesh, torch.device("meta"):
        parallelize_auto(holder, mesh, ParallelConfig.parse(layout), options)
    return holder


def test_blocks_come_from_the_argument_then_no_split_modules_then_the_largest_module_list():
    tiny = TinyLM(layers=3)
    assert find_blocks(tiny) == list(tiny.blocks)  # the largest ModuleList's element class
    assert find_blocks(tiny, ["MLP"]) == [b.mlp for b in tiny.blocks]
    assert find_blocks(tiny, [Block, "MLP"]) == list(tiny.blocks)  # outermost only
    with pytest.raises(ValueError, match=r"block_types \['Decoder'\] match no module of TinyLM"):
        find_blocks(tiny, ["Decoder"])
    llama = _hf("llama")
    assert find_blocks(llama) == list(llama.model.layers)  # _no_split_modules: LlamaDecoderLayer
    gpt2 = _hf("gpt2")
    assert [type(b).__name__ for b in find_blocks(gpt2)] == ["GPT2Block"] * 2


def test_every_block_then_the_root_is_one_fsdp_unit(one_process_group):
    holder = _built(TinyLM(layers=2), "dp_shard=4")
    units = [n for n, m in holder.named_modules() if isinstance(m, FSDPModule)]
    assert units == ["model", "model.blocks.0", "model.blocks.1"]
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in holder.parameters())


def test_a_hugging_face_plan_splits_attention_and_mlp_and_ties_the_embedding_again(one_process_group):
    holder = _built(_hf("llama-tied"), "dp_shard=2,tp=2")
    llama = holder.model
    assert llama.lm_head.weight is llama.model.embed_tokens.weight  # one tensor, as the switch captures it
    assert [names for names in tied_groups(holder)] == [["model.model.embed_tokens.weight", "model.lm_head.weight"]]
    q = llama.model.layers[0].self_attn.q_proj.weight
    o = llama.model.layers[0].self_attn.o_proj.weight
    assert q.placements[-1] == Shard(0) and o.placements[-1] == Shard(1)  # colwise, rowwise on tp
    # the tied tensor lies in the root's unit: no block holds it
    assert all(not any(p is llama.lm_head.weight for p in b.parameters()) for b in llama.model.layers)


def test_a_plan_keyed_from_the_base_model_is_keyed_from_the_causal_lm():
    llama = _hf("llama")
    llama._tp_plan = None
    plan = model_plan(llama)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and "lm_head" not in plan
    assert len(expand(llama, plan)) == 7 * 2


@pytest.mark.parametrize("model,layout,options,message", [
    ("gpt2", "dp_shard=2,tp=2", AutoOptions(), "tp=2 needs a tensor-parallel plan"),
    ("llama", "tp=4", AutoOptions(), "tp=4 does not divide num_key_value_heads=2"),
    ("llama", "dp_shard=2,tp=2", AutoOptions(tp_plan={"model.layers.*.attn.q": "colwise"}),
     "'model.layers.*.attn.q' names no module"),
    ("llama", "dp_shard=2,tp=2", AutoOptions(tp_plan={"model.lm_head": "diagonal"}),
     "style 'diagonal' has no torch counterpart"),
    ("llama-tied", "dp_shard=2,tp=2", AutoOptions(tp_plan={"model.lm_head": "colwise"}),
     "one tied tensor, but the tensor-parallel plan splits them differently"),
    ("llama", "pp=2,dp_shard=2", AutoOptions(), "pipeline and expert parallelism need a model that splits itself"),
], ids=["no-plan", "kv-heads", "unknown-module", "unknown-style", "tie-split-apart", "pipeline"])
def test_what_a_plan_cannot_serve_raises_the_reason(one_process_group, model, layout, options, message):
    with pytest.raises(ValueError, match=message):
        _built(_hf(model), layout, options)


def test_parameters_of_the_lightning_module_itself_are_refused(one_process_group):
    holder = Holder(TinyLM(layers=1))
    holder.scale = nn.Parameter(torch.ones(1))
    with probe_mesh(ParallelConfig(dp_shard=2)) as mesh, pytest.raises(ValueError, match=r"holds parameters itself"):
        parallelize_auto(meta_copy(holder), mesh, ParallelConfig(dp_shard=2), AutoOptions())


def test_lightning_precision_becomes_fsdp_mixed_precision():
    policy = mp_policy_for("bf16-mixed", None)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mp_policy_for("32-true", None) is None and mp_policy_for("bf16-true", None) is None
    given = mp_policy_for("32-true", policy)
    assert mp_policy_for("16-mixed", given) is given
