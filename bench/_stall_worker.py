"""A callback for `bench/stall.py`: every process of an elastic run writes every `SwitchReport` it holds.

`SwitchLog` writes rank 0's reports only (``switches.jsonl``); the stall of a switch is the slowest rank's, so this
callback appends each process's reports to ``$DYNATRAIN_STALL_DIR/reports.<pid>.jsonl`` (one line per report, with
the process's rank when it wrote the line). It is named in the recipe `bench/stall.py` writes; the launcher's
members and standby processes build it from the same recipe. Nothing here changes training.
"""

from __future__ import annotations

import atexit
import json
import os

import lightning.pytorch as pl


class AllRankSwitchReports(pl.Callback):
    def __init__(self) -> None:
        self._written = 0
        self._trainer = None
        self._path = os.path.join(os.environ.get("DYNATRAIN_STALL_DIR", "."), f"reports.{os.getpid()}.jsonl")
        atexit.register(self._flush_at_exit)

    def _flush(self, trainer) -> None:
        self._trainer = trainer
        reports = getattr(trainer.strategy, "switch_reports", None) or []
        if len(reports) <= self._written:
            return
        try:
            rank = int(trainer.global_rank)
        except Exception:  # noqa: BLE001 - a process that left may have no rank any more
            rank = -1
        with open(self._path, "a") as f:
            for report in reports[self._written:]:
                d = report.as_dict() if hasattr(report, "as_dict") else dict(report)
                d["pid"] = os.getpid()
                d["rank"] = rank
                f.write(json.dumps(d, default=str) + "\n")
        self._written = len(reports)

    def _flush_at_exit(self) -> None:
        if self._trainer is not None:
            try:
                self._flush(self._trainer)
            except Exception:  # noqa: BLE001
                pass

    def on_train_start(self, trainer, pl_module) -> None:
        self._trainer = trainer

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._flush(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._flush(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._flush(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._flush(trainer)
