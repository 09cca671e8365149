"""Layout switches into every Lightning logger, a W&B table, ``switches.jsonl``, and the progress bar.

`SwitchLog` watches ``trainer.strategy.switch_reports`` and logs each new `SwitchReport` once, at the step the
switch happened. It works alone (a fixed recipe of ``request_switch`` calls) and under `ElasticCallback`, which
adds the decision behind each switch (signal, source, reason). The report holds this rank's bytes, peak memory
and timings; rank 0's are logged. A switch that changes ep (moves routed experts) also records the expert load it
was made under (``expert_imbalance``: busiest expert's tokens / mean), when the module reports one.

`format_switch_table` and `plot_loss_with_switches` summarise a finished run (``switches.jsonl``, Lightning's CSV
``metrics.csv`` and, when `ReferenceLoss` ran, the loss of the same run without switches).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger

from dynatrain.switch.report import DEVICE_FIELDS  # recorded and logged where a report has them (CUDA)
from dynatrain.vps.parallel_config import ParallelConfig

JSONL_NAME = "switches.jsonl"
REFERENCE_NAME = "reference_loss.csv"  # written by `ReferenceLoss`, drawn by `plot_loss_with_switches`
TABLE_KEY = "switch/table"
TABLE_COLUMNS = ("step", "old_layout", "new_layout", "old_world_size", "world_size", "stall_s", "bytes_moved",
                 "bytes_moved_identity", "peak_bytes", "verified", "expert_imbalance", "source", "reason", "phases")


# ------------------------------------------------------------------------------------------------ records
def report_dict(report: Any) -> dict:
    """A `SwitchReport` (or a dict already, e.g. a line of ``switches.jsonl``) as a plain dict with stall_s."""
    if isinstance(report, Mapping):
        out = dict(report)
    elif hasattr(report, "as_dict"):
        out = report.as_dict()
    else:
        out = dataclasses.asdict(report)
    out.setdefault("stall_s", sum((out.get("phases") or {}).values()))
    return out


def _world_of(layout: str | None) -> int | None:
    # A layout's product of dimensions is the world it runs on, so old and new world sizes need no extra field.
    try:
        return ParallelConfig.parse(layout).world_size if layout else None
    except ValueError:
        return None


def _ep_of(layout: str | None) -> int | None:
    try:
        return ParallelConfig.parse(layout).ep if layout else None
    except ValueError:
        return None


def ep_changed(record: Mapping) -> bool:
    """True when the switch moved routed experts between ranks (its ep degree changed)."""
    old, new = _ep_of(record.get("old_layout")), _ep_of(record.get("new_layout"))
    return old is not None and new is not None and old != new


def add_expert_load(record: dict, module: Any) -> dict:
    """When the switch changed ep, the expert load it was made under: the busiest expert's tokens over the mean,
    per layer and the model's maximum, from a module that offers ``expert_imbalance()`` (the zoo's MoE models)."""
    per_layer = getattr(module, "expert_imbalance", None)
    per_layer = per_layer() if callable(per_layer) and ep_changed(record) else None
    if per_layer:
        record["expert_imbalance"] = max(per_layer)
        record["expert_imbalance_per_layer"] = [round(x, 4) for x in per_layer]
    return record


def switch_record(report: Any, decision: Mapping | None = None) -> dict:
    """One line of ``switches.jsonl``: the report's fields, both world sizes, the decision behind it if any."""
    d = report_dict(report)
    record = {
        "step": d.get("step"),
        "old_layout": d.get("old_layout"),
        "new_layout": d.get("new_layout"),
        "old_world_size": d.get("old_world_size") or _world_of(d.get("old_layout")),
        "world_size": d.get("world_size") or _world_of(d.get("new_layout")),
        "phases": dict(d.get("phases") or {}),
        "stall_s": d.get("stall_s"),
        "bytes_total": d.get("bytes_total"),
        "bytes_moved": d.get("bytes_moved"),
        "bytes_moved_identity": d.get("bytes_moved_identity"),
        "peak_bytes": d.get("peak_bytes"),
        "peak_bound": d.get("peak_bound"),
        "rounds": d.get("rounds"),
        "rank_map": d.get("rank_map"),
        "verified": d.get("verified"),
        "prepared": bool(d.get("prepared")),
        "boundary_wait_s": d.get("boundary_wait_s"),
        "decision": dict(decision) if decision else None,
    }
    for key in ("expert_imbalance", "expert_imbalance_per_layer", "formed_ahead_steps", *DEVICE_FIELDS):
        if d.get(key) is not None:
            record[key] = d[key]
    return record


def switch_metrics(record: Mapping) -> dict[str, float]:
    """The ``switch/...`` metrics of one record; fields the report left empty are left out, not logged as 0."""
    out: dict[str, float] = {}
    for key in ("stall_s", "bytes_moved", "bytes_moved_identity", "peak_bytes", "world_size", "expert_imbalance",
                "compile_s", "boundary_wait_s", "formed_ahead_steps", *DEVICE_FIELDS):
        if record.get(key) is not None:
            out[f"switch/{key}"] = float(record[key])
    for phase, seconds in (record.get("phases") or {}).items():
        out[f"switch/{phase}_s"] = float(seconds)
    out["switch/verified"] = 1.0 if record.get("verified") else 0.0
    if record.get("prepared"):
        out["switch/prepared"] = 1.0  # planned in the background while training went on
    decision = record.get("decision") or {}
    for key in ("agreement_s", "signal_to_decision_s"):
        if decision.get(key) is not None:
            out[f"switch/{key}"] = float(decision[key])
    return out


def _table_row(record: Mapping) -> list:
    decision = record.get("decision") or {}
    values = {**record, "source": decision.get("source", "direct"), "reason": decision.get("reason", ""),
              "phases": json.dumps(record.get("phases") or {}, sort_keys=True)}
    return [values.get(column) for column in TABLE_COLUMNS]


def read_switches(path: str | os.PathLike) -> list[dict]:
    """The records of a ``switches.jsonl``, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------------------ callback
class SwitchLog(pl.Callback):
    """Log every layout switch of a `DynaTrainStrategy` run once, at the step it happened.

    Args:
        log_dir: where ``switches.jsonl`` goes; default ``trainer.log_dir`` (the first logger's run
            directory), else ``trainer.default_root_dir``.
        wandb_table: also log a ``wandb.Table`` of all switches so far to every W&B logger.
        progress_bar: show the current layout in the progress bar as ``layout``.
    """

    def __init__(self, log_dir: str | None = None, wandb_table: bool = True, progress_bar: bool = True) -> None:
        self.log_dir = log_dir
        self.wandb_table = wandb_table
        self.progress_bar = progress_bar
        self.run_dir: Path | None = None
        self.records: list[dict] = []
        self._logged = 0
        self._decisions: dict[int, dict] = {}
        self._bar: tuple[Any, bool, Any] | None = None

    @property
    def jsonl_path(self) -> Path | None:
        return None if self.run_dir is None else self.run_dir / JSONL_NAME

    def note_decision(self, report_index: int, decision: Mapping) -> None:
        """Attach what caused the switch whose report will land at ``strategy.switch_reports[report_index]``."""
        self._decisions[report_index] = dict(decision)

    def _decision_for(self, index: int, report: Any) -> dict | None:
        # A request can be deferred (a scale-out waits for joiners) or dropped: a decision noted for this index
        # explains the report only if it asked for the layout the report switched to.
        for stale in [i for i in self._decisions if i < index]:
            del self._decisions[stale]
        decision = self._decisions.pop(index, None)
        if decision and decision.get("target") not in (None, report_dict(report).get("new_layout")):
            return None
        return decision

    # ---- Lightning hooks ----------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # trainer.log_dir broadcasts from rank 0: every rank must ask, or the others hang.
        self.run_dir = resolve_run_dir(trainer, self.log_dir)
        if self.progress_bar:
            self._wrap_progress_bar(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.flush(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.flush(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        # A switch at the last step lands after the last batch hook.
        self.flush(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._unwrap_progress_bar()

    # ---- logging ------------------------------------------------------------------------------------------
    def flush(self, trainer: pl.Trainer) -> list[dict]:
        """Log the reports that appeared since the last call; returns their records."""
        reports = getattr(trainer.strategy, "switch_reports", None) or []
        new = []
        for index in range(self._logged, len(reports)):
            record = switch_record(reports[index], self._decision_for(index, reports[index]))
            add_expert_load(record, getattr(trainer, "lightning_module", None))
            self.records.append(record)
            new.append(record)
        self._logged = len(reports)
        if new and trainer.is_global_zero:
            for record in new:
                self._emit(trainer, record)
        return new

    def _emit(self, trainer: pl.Trainer, record: dict) -> None:
        step = int(record["step"] or 0)
        metrics = switch_metrics(record)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if self.wandb_table:
            self._log_table(trainer, step)
        self._append_jsonl(record)

    def _log_table(self, trainer: pl.Trainer, step: int) -> None:
        loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        if not loggers:
            return
        import wandb

        rows = [_table_row(r) for r in self.records]
        for logger in loggers:
            # A fresh table each time: W&B tables are immutable once logged. Mixed types: None where a report
            # left a field empty.
            table = wandb.Table(columns=list(TABLE_COLUMNS), data=rows, allow_mixed_types=True)
            logger.log_metrics({TABLE_KEY: table}, step=step)

    def _append_jsonl(self, record: dict) -> None:
        path = self.jsonl_path
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({**record, "time": time.time()}, default=str) + "\n")

    # ---- progress bar -------------------------------------------------------------------------------------
    def _wrap_progress_bar(self, trainer: pl.Trainer) -> None:
        bar = trainer.progress_bar_callback
        if bar is None or self._bar is not None or getattr(bar.get_metrics, "_shows_layout", False):
            return
        had_own, original = "get_metrics" in vars(bar), bar.get_metrics
        strategy = trainer.strategy

        def get_metrics(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
            metrics = original(trainer, pl_module)
            layout = getattr(strategy, "parallel_config", None)
            if layout is not None:
                metrics["layout"] = layout.short()
            return metrics

        get_metrics._shows_layout = True  # type: ignore[attr-defined]
        bar.get_metrics = get_metrics
        self._bar = (bar, had_own, original)

    def _unwrap_progress_bar(self) -> None:
        if self._bar is None:
            return
        bar, had_own, original = self._bar
        self._bar = None
        if had_own:
            bar.get_metrics = original
        else:
            vars(bar).pop("get_metrics", None)


def resolve_run_dir(trainer: pl.Trainer, override: str | os.PathLike | None = None) -> Path:
    """The run directory: ``override``, else ``trainer.log_dir``, else ``default_root_dir``.

    Without an override this is a collective (``trainer.log_dir`` broadcasts rank 0's): call it on every rank.
    """
    if override is not None:
        return Path(override)
    return Path(trainer.log_dir or trainer.default_root_dir)


# ------------------------------------------------------------------------------------------------ summaries
def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _ratio(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_switch_table(reports: Iterable[Any]) -> str:
    """A plain-text table of switches (`SwitchReport` objects, their dicts, or ``switches.jsonl`` records)."""
    records = [switch_record(r, (r.get("decision") if isinstance(r, Mapping) else None)) for r in reports]
    if not records:
        return "no layout switches"
    phases: list[str] = []
    for r in records:
        phases += [p for p in r["phases"] if p not in phases]
    experts = any(r.get("expert_imbalance") is not None for r in records)
    head = ["step", "from", "to", "world", "stall s", *[f"{p} s" for p in phases], "moved MiB", "identity MiB",
            "peak MiB", *(["expert max/mean"] if experts else []), "verified", "trigger"]
    rows = [head]
    for r in records:
        decision = r.get("decision") or {}
        world = f"{r['old_world_size']}->{r['world_size']}" if r["old_world_size"] != r["world_size"] \
            else str(r["world_size"])
        rows.append([
            str(r["step"]), str(r["old_layout"]), str(r["new_layout"]), world, f"{r['stall_s'] or 0:.3f}",
            *[f"{r['phases'].get(p, 0.0):.3f}" for p in phases],
            _mib(r["bytes_moved"]), _mib(r["bytes_moved_identity"]), _mib(r["peak_bytes"]),
            *([_ratio(r.get("expert_imbalance"))] if experts else []),
            {True: "yes", False: "FAILED"}.get(r["verified"], "-"), decision.get("source", "direct"),
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) if i >= 3 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def read_loss_curve(metrics_csv: str | os.PathLike, key: str = "train/loss") -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` from a CSVLogger ``metrics.csv`` (rows without the key are skipped)."""
    steps, values = [], []
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            if row.get(key) not in (None, "") and row.get("step") not in (None, ""):
                steps.append(int(float(row["step"])))
                values.append(float(row[key]))
    return steps, values


def world_size_series(switches: list[Mapping], last_step: int, world_size: int | None = None
                      ) -> tuple[list[int], list[int]]:
    """(steps, world sizes) as a step function from step 0 to ``last_step``: the world before the first switch,
    then each switch's from its step on. Without switches, ``world_size`` throughout (empty when it is None)."""
    first = (switches[0].get("old_world_size") if switches else None) or world_size
    if first is None:
        return [], []
    steps, sizes = [0], [int(first)]
    for record in switches:
        if record.get("world_size") is not None:
            steps.append(int(record["step"]))
            sizes.append(int(record["world_size"]))
    steps.append(max(last_step, steps[-1]))
    sizes.append(sizes[-1])
    return steps, sizes


def loss_switch_figure(steps: list[int], losses: list[float], switches: list[Mapping],
                       reference: tuple[list[int], list[float]] | None = None, world_size: int | None = None,
                       key: str = "train/loss"):
    """Three panels over the optimizer step: the run's loss and the reference's (the same run without switches),
    the world size, and each switch's stall; a dashed line at every switch through all three."""
    # Drawn on an Agg canvas directly: no pyplot, so the caller's matplotlib backend is untouched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 7), dpi=110)
    FigureCanvasAgg(fig)
    ax_loss, ax_world, ax_stall = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.2, 1.2]})
    ax_loss.plot(steps, losses, color="tab:blue", linewidth=1.6, label=f"elastic run ({key})")
    title = "training loss"
    if reference is not None and reference[0]:
        ax_loss.plot(*reference, color="black", linestyle=":", linewidth=1.4, label="same run without switches")
        ref = dict(zip(*reference))
        gaps = [abs(v - ref[s]) for s, v in zip(steps, losses) if s in ref]
        if gaps:
            title += f"; largest difference from the run without switches {max(gaps):.2g}"
    last = max([*steps, *(reference[0] if reference else []), *(int(r["step"]) for r in switches)], default=0)
    w_steps, w_sizes = world_size_series(switches, last, world_size)
    ax_world.step(w_steps, w_sizes, where="post", color="tab:green", linewidth=1.6, label="world size")
    stalls = [(int(r["step"]), float(r.get("stall_s") or 0.0)) for r in switches]
    if stalls:
        bars = ax_stall.bar([s for s, _ in stalls], [t for _, t in stalls], width=max(1.0, last / 80),
                            color="tab:red", label="stall")
        ax_stall.bar_label(bars, labels=[f"{t:.2f}s" for _, t in stalls], fontsize=8)
        ax_stall.set_ylim(0, max(t for _, t in stalls) * 1.35 or 1.0)
    else:
        ax_stall.text(0.5, 0.5, "no layout switches", transform=ax_stall.transAxes, ha="center", va="center")
    for record in switches:
        for ax in (ax_loss, ax_world, ax_stall):
            ax.axvline(record["step"], color="tab:red", linestyle="--", linewidth=0.8, alpha=0.6)
        ax_world.annotate(str(record.get("new_layout")), xy=(record["step"], 1.0), xycoords=("data", "axes fraction"),
                          xytext=(3, -3), textcoords="offset points", va="top", ha="left", fontsize=7,
                          color="tab:red")
    ax_loss.set(ylabel="loss", title=title)
    ax_loss.legend(loc="upper right", fontsize=8)
    ax_world.set(ylabel="world size")
    ax_world.set_ylim(0, max(w_sizes, default=1) + 1)
    ax_world.yaxis.get_major_locator().set_params(integer=True)
    ax_stall.set(ylabel="stall (s)", xlabel="optimizer step")
    for ax in (ax_loss, ax_world, ax_stall):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_loss_with_switches(metrics_csv: str | os.PathLike, switches_jsonl: str | os.PathLike | None,
                            out_png: str | os.PathLike, key: str = "train/loss",
                            reference_csv: str | os.PathLike | None = None, world_size: int | None = None) -> Path:
    """`loss_switch_figure` of a finished run, saved as a PNG: the loss from Lightning's CSV ``metrics.csv``, the
    switches from ``switches.jsonl``, and the reference from ``reference_csv`` (default: `ReferenceLoss`'s
    ``reference_loss.csv`` next to ``switches.jsonl``, drawn when it is there). ``world_size`` is the world of a
    run without switches."""
    steps, values = read_loss_curve(metrics_csv, key)
    switches = read_switches(switches_jsonl) if switches_jsonl and os.path.exists(switches_jsonl) else []
    if reference_csv is None and switches_jsonl:
        reference_csv = Path(switches_jsonl).parent / REFERENCE_NAME
    reference = read_loss_curve(reference_csv, "loss") if reference_csv and os.path.exists(reference_csv) else None
    fig = loss_switch_figure(steps, values, switches, reference, world_size, key)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
