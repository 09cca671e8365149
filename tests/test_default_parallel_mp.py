"""Modules with no configure_model() and nothing written for dynatrain (tests/workers/hf_data.py's AutoLM): the
strategy parallelises them by default (FSDP2 per block, TP from the model's own plan) and they switch online, their
global loss per step that of the run without switches."""

from __future__ import annotations

import pytest
from _launch import assert_close, launch, launch_elastic

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def _assert_switched_as_static(runs: list[dict], static: list[dict], layouts: list[str]) -> None:
    ref = static[0]["losses"]
    for res in runs:
        if res["left"]:
            continue
        assert res["errors"] == []
        assert_close(res["losses"], ref[len(ref) - len(res["losses"]):])  # a joiner records the steps it trained
        assert all(r["verified"] is True for r in res["reports"])  # every state bitwise where it was
        assert [r["new_layout"] for r in res["reports"]] == layouts[len(layouts) - len(res["reports"]):]


def test_a_plain_torch_module_switches_through_dp_replicate_a_scale_in_and_a_scale_out(tmp_path):
    common = ["--model", "tiny", "--steps", "5"]
    static = launch("hf_data.py", 4, common, tmp_path / "static")
    layouts = ["dp_replicate=2,dp_shard=2", "dp_shard=2", "dp_shard=4"]
    args = ["--elastic", *common, "--switches", ";".join(f"{i + 1}:{lay}" for i, lay in enumerate(layouts))]
    # two processes leave at the scale-in; two new ones join at the scale-out
    members, joiners = launch_elastic("hf_data.py", 4, args, tmp_path / "elastic", joiners=[args, args], timeout=400)
    assert sum(m["left"] for m in members) == 2
    assert [r["layout"] for r in members + joiners if not r["left"]] == ["dp_shard=4"] * 4
    _assert_switched_as_static(members + joiners, static, layouts)


@pytest.mark.parametrize("model", ["llama", "llama-tied"])
def test_a_hugging_face_llama_switches_across_dp_and_tp_from_its_own_plan(tmp_path, model):
    pytest.importorskip("transformers")
    common = ["--model", model, "--steps", "4"]
    layouts = ["dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2"]
    static = launch("hf_data.py", 4, common, tmp_path / "static")
    switched = launch("hf_data.py", 4, [*common, "--switches", f"1:{layouts[0]};2:{layouts[1]}"],
                      tmp_path / "switched")
    _assert_switched_as_static(switched, static, layouts)
    tied = [["model.model.embed_tokens.weight", "model.lm_head.weight"]] if model == "llama-tied" else []
    assert all(r["tied"] == tied for r in switched)  # one tensor still, after tp split and re-tied it


def test_qwen2_switches_dp_and_scales_in(tmp_path):
    pytest.importorskip("transformers")
    common = ["--model", "qwen2", "--steps", "4"]
    layouts = ["dp_replicate=2,dp_shard=2", "dp_shard=3"]
    static = launch("hf_data.py", 4, common, tmp_path / "static")
    members, _ = launch_elastic("hf_data.py", 4, ["--elastic", *common, "--switches", f"1:{layouts[0]};2:{layouts[1]}"],
                                tmp_path / "elastic", timeout=400)
    assert sum(m["left"] for m in members) == 1
    _assert_switched_as_static(members, static, layouts)


@pytest.mark.parametrize("model,heads,expected", [
    ("gpt2", 4, "tp=2 needs a tensor-parallel plan"),  # GPT-2 carries no _tp_plan
    ("llama", 3, "tp=2 does not divide num_attention_heads=3"),
], ids=["no-plan", "heads"])
def test_a_tp_layout_the_model_cannot_serve_is_refused_and_training_goes_on(tmp_path, model, heads, expected):
    pytest.importorskip("transformers")
    results = launch("hf_data.py", 2, ["--model", model, "--heads", str(heads), "--layout", "dp_shard=2",
                                       "--steps", "3", "--switches", "1:tp=2"], tmp_path)
    for res in results:
        assert res["reports"] == [] and res["layout"] == "dp_shard=2" and len(res["losses"]) == 3
        [error] = res["errors"]
        assert expected in error, error
        assert res["untouched"] == [True]  # every weight, buffer and optimizer tensor bitwise as before
