"""The demo's plot (loss against the run without switches, world size, each switch's stall) and `ReferenceLoss`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dynatrain.callbacks import switch_log
from dynatrain.callbacks.reference import max_difference, write_reference
from dynatrain.callbacks.switch_log import (
    JSONL_NAME, REFERENCE_NAME, loss_switch_figure, plot_loss_with_switches, switch_record, world_size_series,
)
from tests._rescale_fakes import fake_report


def _switches() -> list[dict]:
    out = []
    for step, old, new, stall in ((3, "dp_shard=4", "dp_shard=2", 0.8), (6, "dp_shard=2", "dp_shard=2,tp=2", 0.3)):
        record = switch_record(fake_report(step, old, new))
        record["stall_s"] = stall
        out.append(record)
    return out


def _lines(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
            if not line.get_label().startswith("_")}


def test_the_figure_has_the_loss_against_the_reference_the_world_size_and_each_stall():
    steps, losses = list(range(10)), [6.0 - 0.4 * s for s in range(10)]
    reference = (list(range(10)), [6.0 - 0.4 * s + (0.01 if s == 7 else 0.0) for s in range(10)])
    fig = loss_switch_figure(steps, losses, _switches(), reference)
    ax_loss, ax_world, ax_stall = fig.axes
    lines = _lines(ax_loss)
    assert lines["elastic run (train/loss)"] == (steps, losses)
    assert lines["same run without switches"] == reference
    assert "0.01" in ax_loss.get_title()  # the largest gap between the two curves
    assert _lines(ax_world)["world size"] == ([0, 3, 6, 9], [4, 2, 4, 4])
    bars = [(p.get_x() + p.get_width() / 2, p.get_height()) for p in ax_stall.patches]
    assert bars == [(3, 0.8), (6, 0.3)]
    assert [t.get_text() for t in ax_stall.texts] == ["0.80s", "0.30s"]
    # Every switch is marked through all three panels.
    for ax in fig.axes:
        assert sorted(line.get_xdata()[0] for line in ax.get_lines() if line.get_label().startswith("_")) == [3, 6]


def test_a_run_without_switches_gets_the_same_three_panels():
    fig = loss_switch_figure([0, 1, 2], [3.0, 2.5, 2.0], [], ([0, 1, 2], [3.0, 2.5, 2.0]), world_size=2)
    ax_loss, ax_world, ax_stall = fig.axes
    assert len(_lines(ax_loss)) == 2 and "largest difference from the run without switches 0" in ax_loss.get_title()
    assert _lines(ax_world)["world size"] == ([0, 2], [2, 2])
    assert not ax_stall.patches and [t.get_text() for t in ax_stall.texts] == ["no layout switches"]
    assert world_size_series([], 5) == ([], [])  # the world is not known: nothing drawn rather than a guess


def test_the_png_draws_the_reference_found_next_to_the_switch_log(tmp_path, monkeypatch):
    (tmp_path / JSONL_NAME).write_text("".join(json.dumps(r) + "\n" for r in _switches()))
    write_reference(tmp_path / REFERENCE_NAME, [6.0, 5.0, 4.5])
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text("epoch,step,train/loss,switch/stall_s\n0,0,6.0,\n0,1,5.0,\n0,2,4.6,\n0,3,,0.8\n")
    seen = {}
    draw = switch_log.loss_switch_figure

    def spy(*args):
        seen["args"] = args
        return draw(*args)

    monkeypatch.setattr(switch_log, "loss_switch_figure", spy)
    out = plot_loss_with_switches(csv_path, tmp_path / JSONL_NAME, tmp_path / "plots" / "loss.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps, losses, switches, reference = seen["args"][:4]
    assert (steps, losses) == ([0, 1, 2], [6.0, 5.0, 4.6]) and [r["step"] for r in switches] == [3, 6]
    assert reference == ([0, 1, 2], [6.0, 5.0, 4.5])
    assert abs(max_difference(losses, reference[1]) - 0.1) < 1e-9


def test_without_matplotlib_the_plot_raises_import_error(tmp_path, monkeypatch):
    (tmp_path / "metrics.csv").write_text("epoch,step,train/loss\n0,0,6.0\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError):
        plot_loss_with_switches(tmp_path / "metrics.csv", None, tmp_path / "loss.png")


_FIT = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    import dynatrain
    from dynatrain.callbacks.reference import ReferenceLoss
    from dynatrain.data import LlamaDataModule
    from dynatrain.lm.causal_lm import CausalLM

    out = sys.argv[1]
    pl.seed_everything(1234, verbose=False)
    reference = ReferenceLoss(log_dir=out)
    trainer = pl.Trainer(strategy="dynatrain", accelerator="cpu", devices=1, max_steps=5, log_every_n_steps=1,
                         logger=CSVLogger(out, name="csv"), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                         use_distributed_sampler=False, callbacks=[reference])
    module = CausalLM(model="debug", model_overrides={"n_layers": 1}, lr=3e-3, warmup_steps=2)
    module.hparams["_instantiator"] = "lightning.pytorch.cli.instantiate_module"  # as LightningCLI adds it
    trainer.fit(module, datamodule=LlamaDataModule(seq_len=32, global_batch_size=8, micro_batch_size=2,
                                                   max_corpus_bytes=200_000))
    print(json.dumps({"run": module.step_losses, "reference": reference.losses, "path": str(reference.path)}))
""")


@pytest.mark.timeout(480)
def test_the_reference_of_a_run_without_switches_is_that_run(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _FIT, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["reference"]) == 5 == len(result["run"])
    assert max_difference(result["run"], result["reference"]) < 1e-5, result
    # The run's CSV logs step k's loss at step k, as the reference file does: the plot compares like with like.
    (metrics,) = list((tmp_path / "csv").rglob("metrics.csv"))
    steps, losses = switch_log.read_loss_curve(metrics)
    ref_steps, ref_losses = switch_log.read_loss_curve(result["path"], "loss")
    assert steps == ref_steps
    assert max_difference(losses, ref_losses) < 1e-5
    assert "reference without switches: 5 steps on 1 process" in proc.stdout + proc.stderr
