"""`dynatrain fit --print-plan`: a cluster recipe states the layout policy's prediction for it, and that prediction
fits 80 GB with the memory model's error to spare."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dynatrain.cli.print_plan import MODEL_ERROR, DeviceSpec, format_plan, plan_recipe
from dynatrain.cli.train import run_lightning_cli

REPO = Path(__file__).resolve().parents[1]
CLUSTER = sorted(p for p in (REPO / "recipes").glob("*.yaml")
                 if yaml.safe_load(p.read_text())["trainer"].get("accelerator") == "gpu")


def _print_plan(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        run_lightning_cli(["fit", *args, "--print-plan"])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_the_cluster_recipes_are_found():
    assert {p.stem for p in CLUSTER} >= {"llama-1b", "llama3-8b", "llama3-70b", "llama3-405b", "qwen3-30b-a3b"}


@pytest.mark.parametrize("recipe", CLUSTER, ids=lambda p: p.stem)
def test_a_cluster_recipe_states_its_prediction_and_fits_80_gb_with_margin(recipe, capsys):
    code, out, err = _print_plan(["--config", str(recipe)], capsys)
    plan = plan_recipe(yaml.safe_load(recipe.read_text()), DeviceSpec(memory_gb=80))
    assert code == 0, err
    assert plan.fits_with_margin, format_plan(plan)
    assert plan.layout.memory.total * (1 + MODEL_ERROR) <= plan.layout.memory_limit
    stated = [line for line in recipe.read_text().splitlines() if line.startswith("# --print-plan")]
    assert stated == [plan.headline()], "the recipe's header must state what --print-plan prints now"
    assert plan.headline() in out and "fits" in out and "policy's best" in out


def test_a_layout_that_cannot_run_is_said_and_exits_1(capsys):
    code, out, _ = _print_plan(["--config", str(REPO / "recipes/llama3-405b.yaml"),
                                "--trainer.strategy.init_args.parallelism.activation_checkpointing", "none"], capsys)
    assert code == 1
    assert "DOES NOT FIT by 88.7 GiB" in out and "cannot run: does not fit memory" in out
    # the same layout on 141 GB devices with per-op checkpointing fits, with less spare than the model's error
    code, out, _ = _print_plan(["--config", str(REPO / "recipes/llama3-405b.yaml"), "--plan.memory_gb", "141",
                                "--trainer.strategy.init_args.parallelism.activation_checkpointing", "selective:op"],
                               capsys)
    assert code == 0 and "104.0 GiB of 118.2 usable" in out and "may run out of memory" in out


@pytest.mark.parametrize("args,message", [
    (["--trainer.devices", "auto"], "--print-plan needs a device count: trainer.devices is 'auto'"),
    (["--trainer.strategy", "ddp"], "--print-plan predicts dynatrain's layouts; trainer.strategy is 'ddp'"),
])
def test_what_print_plan_cannot_predict_is_an_error(args, message, capsys):
    code, _, err = _print_plan(["--config", str(REPO / "recipes/llama3-8b.yaml"), *args], capsys)
    assert code == 2 and message in err, err


def test_sequence_parallelism_keeps_sequence_gathered_tensors_as_measured():
    from dynatrain.policy import Workload, estimate_memory
    from dynatrain.vps import ParallelConfig

    cfg = ParallelConfig.parse("dp_shard=4,tp=8")
    memory = {(sp, ac): estimate_memory(cfg, Workload("llama3-70b", seq_len=4096, global_batch=32, sequence_parallel=sp,
                                                      activation_checkpointing=ac)).activations
              for sp in (False, True) for ac in ("none", "selective:op", "full")}
    assert memory[False, "none"] > memory[False, "selective:op"] > memory[False, "full"]
    assert memory[True, "none"] > memory[True, "selective:op"] and memory[True, "none"] > memory[True, "full"]
    # sequence parallelism splits the norms but not the matmuls' all-gathered inputs: it saves less than 1/tp
    assert memory[False, "none"] > memory[True, "none"] > memory[False, "none"] / 8
    # a block checkpointed whole keeps three sequence-gathered tensors per token (bench/results/memory_model/)
    assert memory[True, "full"] > memory[False, "full"]
