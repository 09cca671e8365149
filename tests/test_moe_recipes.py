"""The mixture-of-experts recipes: moe-debug trains through `dynatrain fit` with ep and tp switches and logs the
expert load; the Qwen3-30B-A3B cluster recipe's layout fits its model and devices."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dynatrain.lm.moe_load import imbalance, load_metrics, zoo_config
from dynatrain.vps.parallel_config import ParallelConfig

REPO = Path(__file__).resolve().parent.parent


def _short_recipe(tmp_path: Path) -> Path:
    """moe-debug with its switches every 3 steps (ep 1 -> 4, tp beside ep=2, ep 2 -> 1), logs every step, CSV only."""
    cfg = yaml.safe_load((REPO / "recipes/moe-debug.yaml").read_text())
    trainer = cfg["trainer"]
    trainer.update(max_steps=10, log_every_n_steps=1, default_root_dir=str(tmp_path / "run"))
    elastic = next(c for c in trainer["callbacks"] if c["class_path"].endswith("ElasticCallback"))
    layouts = [entry["layout"] for entry in elastic["init_args"]["trace"]]
    elastic["init_args"]["trace"] = [{"step": 3 * (i + 1), "layout": layout} for i, layout in enumerate(layouts)]
    trainer["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                          "init_args": {"save_dir": str(tmp_path / "run"), "name": "csv"}}]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_moe_debug_recipe_trains_switches_ep_and_logs_expert_load(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "dynatrain.cli", "fit", "--config", str(_short_recipe(tmp_path))]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    [jsonl] = list((tmp_path / "run").rglob("switches.jsonl"))
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["old_layout"], r["new_layout"]) for r in records] == [
        ("dp_shard=4", "dp_shard=4,ep=4"), ("dp_shard=4,ep=4", "dp_shard=2,tp=2,ep=2"),
        ("dp_shard=2,tp=2,ep=2", "dp_shard=4")]
    assert all(r["verified"] for r in records)
    # The expert load is recorded at the switches that change ep: all three here (4, 2, then 1).
    assert [r.get("expert_imbalance") is not None for r in records] == [True, True, True]
    assert all(1.0 <= r["expert_imbalance"] <= 4.0 and len(r["expert_imbalance_per_layer"]) == 2
               for r in (records[0], records[2]))
    [metrics_csv] = list((tmp_path / "run").rglob("metrics.csv"))
    rows = [row for row in csv.DictReader(metrics_csv.open()) if row.get("moe/imbalance_max")]
    assert len(rows) == 10, out[-3000:]  # every step, through every layout
    for row in rows:
        layers = [float(row[f"moe/layer{i}/imbalance"]) for i in range(2)]
        assert float(row["moe/imbalance_max"]) == max(layers) and all(1.0 <= x <= 4.0 for x in layers)
        # the job's tokens: 16 sequences x 128 tokens, 2 choices each, whatever dp, tp and ep are
        assert sum(float(row[f"moe/layer0/expert{e}_tokens"]) for e in range(8)) == 16 * 128 * 2
    assert "expert load max/mean" in out and "expert max/mean" in out  # the step line and the switch table


def test_qwen3_30b_a3b_recipe_layout_fits_its_model_and_devices():
    cfg = yaml.safe_load((REPO / "recipes/qwen3-30b-a3b.yaml").read_text())
    trainer, model, data = cfg["trainer"], cfg["model"], cfg["data"]
    devices = trainer["devices"] * trainer["num_nodes"]
    pcfg = ParallelConfig.parse(trainer["strategy"]["init_args"]["parallel"])
    config = zoo_config(model["model"], model.get("model_overrides"))
    assert pcfg.validate(config, devices) is pcfg
    # ep stays inside a node: with tp=1 an ep group is ep consecutive ranks.
    assert pcfg.tp == 1 and trainer["devices"] % pcfg.ep == 0
    assert data["global_batch_size"] % (pcfg.dp_size * data["micro_batch_size"]) == 0
    assert data["seq_len"] <= config.max_seq_len


def test_expert_load_metrics():
    import torch

    counts = torch.tensor([[4.0, 4.0, 4.0, 4.0], [8.0, 0.0, 4.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    assert imbalance(counts).tolist() == [1.0, 2.0, 0.0]
    metrics = load_metrics(counts, per_expert=False)
    assert metrics["moe/imbalance_max"] == 2.0 and metrics["moe/layer1/imbalance"] == 2.0
    assert not any("tokens" in key for key in metrics)
    assert load_metrics(counts, per_expert=True)["moe/layer1/expert0_tokens"] == 8.0


def test_switch_log_records_expert_load_only_when_ep_changes():
    from types import SimpleNamespace

    from dynatrain.callbacks.switch_log import add_expert_load, format_switch_table

    module = SimpleNamespace(expert_imbalance=lambda: [1.5, 2.25])
    moved = add_expert_load({"old_layout": "dp_shard=4", "new_layout": "dp_shard=4,ep=2"}, module)
    assert moved["expert_imbalance"] == 2.25 and moved["expert_imbalance_per_layer"] == [1.5, 2.25]
    kept = add_expert_load({"old_layout": "dp_shard=4,ep=2", "new_layout": "dp_shard=2,tp=2,ep=2"}, module)
    assert "expert_imbalance" not in kept
    assert "expert_imbalance" not in add_expert_load({"old_layout": "dp_shard=4", "new_layout": "dp_shard=4,ep=2"},
                                                     SimpleNamespace())  # a dense model reports no load
    table = format_switch_table([{**moved, "step": 3}, {**kept, "step": 6}])
    assert "expert max/mean" in table and "2.25" in table
