"""Before survivors rebuild the state from replicas: do the copies they would read agree, bit for bit?

GPU work is asynchronous. When a peer dies, each survivor has queued work behind the collective that failed, and
what of it ran differs between them: one may have applied an optimizer step (on gradients a failed reduction left
half-written) that another never reached. A recovery reads every region from one of the survivors that hold it, so
copies that differ would be trained on silently, each process from another past. So every survivor hashes each box
of the old layout it holds (`hashing.PieceSums`: the switch check's hash, by the box's global indices, read from a
GPU in one transfer) and each scalar it keeps (the optimizer's ``step`` per parameter, its hyper-parameters, the LR
schedulers' states; `scalar_hash`), hands the list over with its report of being alive
(`ElasticManager.agree_on_survivors`, through the job's store: no collective on a world that is broken or not formed
yet), and every survivor compares, from the same agreed reports, the sums of each region among the survivors that
hold it. Any difference stops the recovery on every survivor alike, naming the states, and the job resumes from its
snapshot.

A report lists only sums, in the order of the old layout's boxes (states in order, each process's boxes in order),
which every survivor derives from the same layout; about 20 bytes per box. Its cost is one read of this process's
state (0.14 s per GiB of float32 on one CPU thread, `hashing`), before it reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dynatrain.check.hashing import PieceSums
from dynatrain.check.module_states import PARAM_GROUP, SCHEDULER
from dynatrain.check.scalars import scalar_hash
from dynatrain.vps.layout import Layout

SHOWN = 8  # states named in an error at most; the count says how many more differ


@dataclass
class ReplicaSums:
    """One survivor's hashes: per box it holds of the old layout, in layout order (`box_order`); per kept scalar,
    by name."""

    boxes: list[int]
    scalars: dict[str, int]

    def to_json(self) -> dict:
        return {"boxes": self.boxes, "scalars": self.scalars}

    @classmethod
    def from_json(cls, d: Mapping) -> ReplicaSums:
        try:
            return cls([int(x) for x in d["boxes"]], {str(k): int(v) for k, v in d["scalars"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"a survivor's replica sums are malformed ({type(e).__name__}: {e})") from None


def box_order(layout: Layout, process: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(state, box lo, box hi) of every box ``process`` holds, in the order its sums are listed."""
    out = []
    for spec in layout.states:
        for box in layout.boxes(spec.name, process):
            out.append((spec.name, box.lo, box.hi))
    return out


def kept_scalars(kept) -> dict[str, object]:
    """Every value a survivor keeps beside its routed shards, by a name alike on every process (`states.Kept`)."""
    out: dict[str, object] = {}
    for param, entries in kept.scalars.items():
        for key, value in entries.items():
            out[f"{param}.{key}"] = value
    for i, group in enumerate(kept.groups):
        out[f"{PARAM_GROUP}.{i}"] = group
    for i, state in enumerate(kept.schedulers):
        out[f"{SCHEDULER}.{i}"] = state
    return out


def local_sums(layout: Layout, process: int, sources: Mapping[str, torch.Tensor],
               scalars: Mapping[str, object]) -> ReplicaSums:
    """This survivor's hashes of what it holds: ``process`` is its id in ``layout``, ``sources`` its local tensors
    of the old layout's states."""
    # On a GPU every box's sum stays on the device until one transfer reads them all.
    with PieceSums(len(box_order(layout, process))) as sums:
        k = 0
        for spec in layout.states:
            held = layout.shards(spec.name, process)
            if held is None or not held.boxes:
                continue
            local = sources.get(spec.name)
            if local is None or tuple(local.shape) != tuple(held.local_shape):
                raise ValueError(f"state {spec.name!r}: the layout gives process {process} a local tensor of shape "
                                 f"{tuple(held.local_shape)}, it holds "
                                 f"{'none' if local is None else tuple(local.shape)}")
            for box, origin in zip(held.boxes, held.offsets):
                hi = tuple(o + h - l for o, l, h in zip(origin, box.lo, box.hi))
                piece = local[tuple(slice(a, b) for a, b in zip(origin, hi))]
                sums.add(k, piece, [range(a, b) for a, b in zip(box.lo, box.hi)], spec.shape)
                k += 1
        boxes = sums.totals()
    return ReplicaSums(boxes, {name: scalar_hash(name, value) for name, value in sorted(scalars.items())})


@dataclass
class Comparison:
    differing: dict[str, str]  # state -> how its copies differ
    compared: int  # regions and scalars held by two or more survivors, compared


def compare(layout: Layout, reports: Mapping[int, ReplicaSums]) -> Comparison:
    """The survivors' reports (by process id in ``layout``) compared region by region: a box held by several
    survivors must have one sum, and every scalar one hash on every survivor. The same answer on every survivor,
    given the same reports."""
    regions: dict[tuple, dict[int, int]] = {}
    differing: dict[str, str] = {}
    for process, report in sorted(reports.items()):
        order = box_order(layout, process)
        if len(order) != len(report.boxes):
            differing["#layout"] = (f"process {process} listed {len(report.boxes)} box sums, the old layout gives it "
                                    f"{len(order)} boxes")
            continue
        for key, value in zip(order, report.boxes):
            regions.setdefault(key, {})[process] = value
    compared = 0
    for (state, lo, hi), by_process in regions.items():
        if len(by_process) < 2:
            continue
        compared += 1
        if len(set(by_process.values())) > 1 and state not in differing:
            differing[state] = f"box {list(lo)}..{list(hi)} differs between processes {_split(by_process)}"
    names = sorted({n for r in reports.values() for n in r.scalars})
    for name in names:
        by_process = {p: r.scalars.get(name) for p, r in sorted(reports.items())}
        if len(by_process) < 2:
            continue
        compared += 1
        if len(set(by_process.values())) > 1:
            missing = [p for p, v in by_process.items() if v is None]
            differing[name] = (f"processes {missing} do not hold it" if missing
                               else f"differs between processes {_split(by_process)}")
    return Comparison(differing, compared)


def _split(by_process: Mapping[int, object]) -> str:
    """The processes grouped by the value they hold: ``[0, 2] / [1]``."""
    groups: dict[object, list[int]] = {}
    for p, v in sorted(by_process.items()):
        groups.setdefault(v, []).append(p)
    return " / ".join(str(g) for g in groups.values())


def explain(differing: Mapping[str, str], names: Sequence[str] | None = None) -> str:
    """The error's text: the first `SHOWN` states and how their copies differ (``names``: process id -> member)."""
    items = list(differing.items())
    text = "; ".join(f"{state}: {how}" for state, how in items[:SHOWN])
    more = f"; and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    who = f" (processes are the old ranks of {list(names)})" if names else ""
    return (f"the survivors' copies of {len(items)} state(s) differ, so they did not all stop after the same "
            f"optimizer step (work queued behind the failed collective ran on some of them only){who}: {text}{more}")
