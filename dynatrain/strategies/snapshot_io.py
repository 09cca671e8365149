"""Reading snapshots: which one is committed and latest, and loading one into the current layout in place.

The `Snapshot` callback writes them; the strategy reads them for ``ckpt_path=`` (a snapshot loads into any
layout and world size). Any process can read; no process group is needed but for the load itself.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import _init_optim_state, get_state_dict, set_state_dict

SNAPSHOTS_KEY = "elastic/snapshots"  # in an elastic job's store: the snapshot directory
MARKER = "COMMITTED"
META = "snapshot.json"
LATEST = "latest"
STEP_NAME = re.compile(r"^step-(\d+)$")
PARTIAL_NAME = re.compile(r"^step-(\d+)\.partial$")


def is_committed(path: str | os.PathLike) -> bool:
    path = Path(path)
    return bool(STEP_NAME.match(path.name)) and (path / MARKER).is_file()


def committed_steps(root: Path) -> dict[int, Path]:
    """Step -> directory of each committed snapshot under ``root``."""
    out = {}
    for p in root.iterdir() if root.is_dir() else ():
        m = STEP_NAME.match(p.name)
        if m and is_committed(p):
            out[int(m.group(1))] = p
    return out


def latest_snapshot(dirpath: str | os.PathLike) -> Path | None:
    """The most recently committed snapshot under ``dirpath``, or None. Partial and unmarked ones never count."""
    root = Path(dirpath)
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        name = ""
    if STEP_NAME.match(name) and is_committed(root / name):
        return root / name
    # No usable pointer (a crash between commit and pointer update, or it was removed): the newest marked one.
    steps = committed_steps(root)
    return steps[max(steps)] if steps else None


def state_module(pl_module: pl.LightningModule) -> torch.nn.Module:
    """The module whose state a snapshot holds: the LightningModule's ``model`` where it has one."""
    inner = getattr(pl_module, "model", None)
    return inner if isinstance(inner, torch.nn.Module) else pl_module


def restore_snapshot(strategy, pl_module: pl.LightningModule, path: str | os.PathLike) -> dict:
    """Load a committed snapshot's model and optimizer state into the strategy's current layout, in place.

    Every rank of the current world calls it with the same path. DCP reshards from whatever layout and world
    size the snapshot was written with; the optimizer's hyper-parameters (the LR) come back with its state.
    Returns the snapshot's metadata (``step``, ``epoch``, ``layout``, ``world_size`` and ``checkpoint``: the loop,
    LR-scheduler, data-module and callback state as a Lightning checkpoint holds them) for the caller to reset
    the loop with.
    """
    path = Path(path)
    if not is_committed(path):
        raise ValueError(f"{path} is not a committed snapshot (a step-<N> directory holding {MARKER}): it may be "
                         "half-written; pass latest_snapshot(dirpath) instead")
    model, optimizers = state_module(pl_module), list(strategy.optimizers)
    if not optimizers:
        raise ValueError("restore_snapshot needs the optimizer: call it after the strategy set up optimizers "
                         "(during fit)")
    for opt in optimizers:
        _init_optim_state(opt)  # an optimizer that never stepped has no state tensors for DCP to fill
    msd, osd = get_state_dict(model, optimizers)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads((path / META).read_text())
