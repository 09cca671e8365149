"""What one layout switch reports: its phases, bytes and memory, as every rank saw them; and its publication
to the strategy's reports, the log and the `after_switch` hooks."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from lightning.pytorch.utilities import rank_zero_info

from dynatrain.engine.verify import SwitchVerificationError
from dynatrain.vps.parallel_config import ParallelConfig

if TYPE_CHECKING:
    from dynatrain.strategies.switcher import Switcher


@dataclass
class SwitchReport:
    """One layout switch, as every rank saw it (bytes and peak are this rank's unless named total)."""

    step: int
    old_layout: str
    new_layout: str
    world_size: int  # processes in the new world (0 on a process that left)
    bytes_total: int
    bytes_moved: int
    bytes_moved_identity: int | None
    rounds: int
    rank_map: list[int]
    peak_bytes: int
    peak_bound: int
    verified: bool | None
    phases: dict[str, float] = field(default_factory=dict)
    old_world_size: int | None = None
    prepared: bool = False  # planned in the background while training went on (a scale-out, or plan_ahead)
    # torch.compile of the target's blocks, None when off: compiled at the first step on the new layout (it needs the
    # moved weights), outside the stall; filled in as that step runs.
    compile_s: float | None = None
    # The freed heap was given back to the OS after the switch (`memory.release_freed_memory`): the next step maps
    # its working memory again.
    heap_trimmed: bool = False

    @property
    def stall_s(self) -> float:
        return sum(self.phases.values())

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stall_s"] = self.stall_s
        return d


class PhaseTimer:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._t
        self._t = now


def check_unchanged(bad: list[str], old_cfg: ParallelConfig, target: ParallelConfig) -> bool:
    """True when no state changed; else the switch fails with the states that did."""
    if bad:
        raise SwitchVerificationError(
            f"switch {old_cfg.short()} -> {target.short()} changed {len(bad)} state(s), e.g. {bad[:5]}"
        )
    return True


def publish_report(switcher: "Switcher", plan, old_cfg: ParallelConfig, target: ParallelConfig, positions, stats,
                   verified: bool | None, timer: PhaseTimer, prepared: bool = False,
                   heap_trimmed: bool = False) -> SwitchReport:
    """The report of a switch that completed on this process: kept by the strategy, logged, handed to every
    `after_switch` hook."""
    strategy = switcher.strategy
    report = SwitchReport(
        step=switcher.trainer.global_step if switcher.trainer else 0,
        old_layout=old_cfg.short(), new_layout=target.short(),
        world_size=target.world_size if not getattr(strategy, "detached", False) else 0,
        bytes_total=plan.bytes_total, bytes_moved=plan.bytes_moved,
        bytes_moved_identity=plan.bytes_moved_identity, rounds=plan.num_rounds, rank_map=list(positions),
        peak_bytes=stats.peak_bytes, peak_bound=stats.peak_bound, verified=verified, phases=timer.phases,
        old_world_size=old_cfg.world_size, prepared=prepared, heap_trimmed=heap_trimmed,
    )
    strategy.switch_reports.append(report)
    rank_zero_info(
        f"layout switch {report.old_layout} -> {report.new_layout} at step {report.step}: "
        f"{report.bytes_moved / 2**20:.1f} MiB moved of {report.bytes_total / 2**20:.1f} MiB, "
        f"stall {report.stall_s:.3f}s" + (", verified bitwise" if verified else "")
    )
    for hook in strategy.after_switch:
        hook(report)
    return report
