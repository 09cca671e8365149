"""Stand-ins for a trainer and a `DynaTrainStrategy`, for the callback tests that run without processes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from dynatrain.models.configs import get_model_config
from dynatrain.switch.report import SwitchReport
from dynatrain.strategies.options import SwitchingOptions
from dynatrain.vps.parallel_config import ParallelConfig

DEBUG = get_model_config("debug").with_overrides(n_layers=2)


class FakeStrategy:
    """What ElasticCallback uses of DynaTrainStrategy; request_switch checks like the real one, switches at once."""

    def __init__(self, layout: str = "dp_shard=2", world: int = 2) -> None:
        self.parallel_config = ParallelConfig.parse(layout)
        self.world_size = world
        self.positions = list(range(world))
        self.switching = SwitchingOptions(switch_budget_mb=256)
        self.switch_reports: list = []
        self.requests: list = []
        self.boundary = True
        self.step = 0

    def at_step_boundary(self) -> bool:
        return self.boundary

    def model_config(self):
        return DEBUG

    def request_switch(self, target):
        target = ParallelConfig.parse(target).validate(DEBUG, self.world_size)
        self._apply(target, ())
        return target

    def _apply(self, target, leave) -> None:
        self.requests.append((target.short(), tuple(leave)))
        self.switch_reports.append(fake_report(self.step, self.parallel_config.short(), target.short()))
        self.parallel_config = target


class ElasticFakeStrategy(FakeStrategy):
    def request_switch(self, target, leave=()):
        target = ParallelConfig.parse(target)
        self._apply(target, leave)
        return target


class WaitingFakeStrategy(FakeStrategy):
    """An elastic strategy whose request_switch also takes ``wait``, as DynaTrainStrategy's does."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.waits: list[bool] = []

    def request_switch(self, target, leave=(), wait=False):
        target = ParallelConfig.parse(target)
        self.waits.append(wait)
        self._apply(target, leave)
        self.world_size, self.positions = target.world_size, list(range(target.world_size))
        return target


class AheadFakeStrategy(WaitingFakeStrategy):
    """One whose request_switch also takes ``plan_ahead``, as DynaTrainStrategy's does."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.ahead: list[bool] = []

    def request_switch(self, target, leave=(), wait=False, plan_ahead=False):
        self.ahead.append(plan_ahead)
        return super().request_switch(target, leave, wait)


def fake_report(step: int, old: str, new: str) -> SwitchReport:
    return SwitchReport(step=step, old_layout=old, new_layout=new, world_size=ParallelConfig.parse(new).world_size,
                        bytes_total=4096, bytes_moved=1024, bytes_moved_identity=2048, rounds=1, rank_map=[0, 1],
                        peak_bytes=8192, peak_bound=9000, verified=True,
                        phases={"plan": 0.01, "build": 0.02, "transfer": 0.03, "adopt": 0.04})


class RecordingLogger:
    def __init__(self) -> None:
        self.calls: list = []

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))


def fake_trainer(strategy, tmp_path: Path, rank: int = 0, **kw):
    data = SimpleNamespace(seq_len=64, global_batch_size=8, micro_batch_size=2)
    return SimpleNamespace(strategy=strategy, global_step=0, global_rank=rank, is_global_zero=rank == 0,
                           datamodule=data, precision="32-true", loggers=kw.get("loggers", []), callbacks=[],
                           progress_bar_callback=kw.get("bar"), log_dir=str(tmp_path), default_root_dir=str(tmp_path))
