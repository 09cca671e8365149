"""Merge what the processes of a selfcheck run reported into one account of its switches and losses.

In an elastic run no process sees everything: a leaver saw the switches up to the one it left at, a joiner the
ones from its admission on. Every process of a world reports the same oracle verdict (it is all-reduced) and the
same loss per step (so is the loss), so the merge only has to collect them.
"""

from __future__ import annotations

def merge_switches(results: list[dict]) -> list[dict]:
    """One entry per switch, in order: the oracle's verdicts, the plan's bytes, the slowest rank's stall and the
    highest rank's peak."""
    by_index: dict[int, list[dict]] = {}
    for res in results:
        for rec in res["switches"]:
            by_index.setdefault(rec["index"], []).append(rec)
    return [_merge_one(by_index[i]) for i in sorted(by_index)]


def _merge_one(records: list[dict]) -> dict:
    ran = [r for r in records if "bytes_moved" in r]  # the processes of the old world, leavers included
    out = {k: records[0][k] for k in ("from", "to", "world_from", "world_to")}
    out["bitwise_equal"] = _verdict(r["bitwise_equal"] for r in records)
    # Every process of the new world, joiners included, takes part in the oracle's collective load.
    out["compared_on"] = sum(r["bitwise_equal"] is not None for r in records)
    out["step_after_equal"] = _verdict(r["step_after_equal"] for r in records)
    out["bytes_moved"] = ran[0]["bytes_moved"] if ran else None
    out["seconds"] = max((r["seconds"] for r in ran), default=None)
    out["peak_bytes"] = max((r.get("peak_bytes") for r in ran if r.get("peak_bytes") is not None), default=None)
    if any(r.get("death") for r in records):
        out["death"] = True  # a process killed mid-step: the survivors rebuilt the state from replicas
    if any(r.get("dropped") for r in records):
        out["dropped"] = True  # a scale-out whose joiners never got ready: nothing was switched
    return out


def _verdict(values) -> bool | None:
    """False if any process saw a difference, True if some compared and all agreed, None if none compared."""
    seen = [v for v in values if v is not None]
    if not seen:
        return None
    return all(seen)


def merge_losses(results: list[dict]) -> list[float]:
    """The loss of every optimizer step, from whichever processes trained it."""
    by_step: dict[int, float] = {}
    for res in results:
        for k, loss in enumerate(res["losses"]):
            by_step.setdefault(res.get("first_step", 0) + k, loss)
    return [by_step[k] for k in sorted(by_step)]


def merge_samples(results: list[dict]) -> list[list[int]]:
    """The global sample indices of every optimizer step (empty where the data is not the strategy's to split)."""
    by_step: dict[int, list[int]] = {}
    for res in results:
        for k, samples in enumerate(res.get("samples") or []):
            by_step.setdefault(res.get("first_step", 0) + k, samples)
    return [by_step[k] for k in sorted(by_step)]
