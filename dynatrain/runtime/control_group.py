"""The control channel: the collectives that carry metadata, on a gloo group of their own beside training's.

A request's agreement, the batch fingerprints, a switch's checksums and cost figures, the pipeline stages' state
tables: all are small values made on the host. NCCL takes device tensors only ("No backend type associated with
device type cpu"), and moving each value to the device and back would add a device sync to every boundary. So
every process of a world makes one gloo group over the whole world (`new_control_group`, right after the world
forms) and metadata travels there as CPU tensors; the training groups carry device tensors only. On CPU both are
gloo and the split costs one group per world; it keeps the code that runs here the code that runs on NCCL.

Every function is a collective of ``group``: each of its ranks calls it, in the same order. Without an initialised
process group each returns this process's own values, as a world of one would.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

BACKEND = "gloo"


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    # torch 2.13 deprecates all_gather_into_tensor for all_gather_single, which older releases lack.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine, group=group)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def new_control_group(timeout: timedelta | None = None) -> dist.ProcessGroup | None:
    """A gloo group of every rank of the current world; each of them calls this at the same point of its group
    creations (torch names groups by a counter every rank must advance alike). The barrier makes its first
    operation one that every rank joins, so no later caller meets a half-formed group. None without a world."""
    if not distributed():
        return None
    group = dist.new_group(backend=BACKEND, timeout=timeout)
    dist.barrier(group=group)
    return group


def _reduce(values: Sequence, dtype: torch.dtype, op, group) -> list:
    t = torch.tensor(list(values), dtype=dtype)
    if distributed():
        dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_reduce_ints(values: Sequence[int], group, op=dist.ReduceOp.SUM) -> list[int]:
    """``values`` (int64 each) reduced element-wise over ``group``."""
    return _reduce(values, torch.int64, op, group)


# Up to this many ranks `sum_ints` all-gathers: gloo's ring all-gather makes half the sequential steps of its
# all-reduce (3 against 6 on 4 ranks), each one a wait for a peer to be scheduled where processes share cores
# (500 int64 on 4 processes sharing 2 cores: 0.7 against 1.2 ms at best, 3.1 against 5 ms median); its bytes grow with
# the ranks, so a larger group all-reduces.
GATHER_SUM_RANKS = 8


def sum_ints(values: Sequence[int], group) -> list[int]:
    """``values`` (int64 each) summed element-wise over ``group``, modulo 2**64 as `all_reduce_ints` sums them."""
    if not distributed() or dist.get_world_size(group) > GATHER_SUM_RANKS or not values:
        return all_reduce_ints(values, group)
    mine = torch.tensor(list(values), dtype=torch.int64)
    out = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.int64)
    _all_gather(out, mine, group)
    return out.view(-1, mine.numel()).sum(0).tolist()


def all_reduce_floats(values: Sequence[float], group, op=dist.ReduceOp.SUM) -> list[float]:
    """``values`` (float64 each) reduced element-wise over ``group``."""
    return _reduce(values, torch.float64, op, group)


def all_gather_ints(values: Sequence[int], group) -> list[list[int]]:
    """Every rank's ``values`` (the same length everywhere), in the group's rank order."""
    mine = torch.tensor(list(values), dtype=torch.int64)
    if not distributed():
        return [mine.tolist()]
    out = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.int64)
    _all_gather(out, mine, group)
    return out.view(-1, mine.numel()).tolist()


def all_gather_bytes(data: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``data`` (a CPU uint8 tensor of the same length everywhere) back to back, in rank order."""
    if not distributed():
        return data.clone()
    out = torch.empty(dist.get_world_size(group) * data.numel(), dtype=torch.uint8)
    _all_gather(out, data, group)
    return out


def all_gather_object(obj: object, group) -> list:
    """Every rank's picklable ``obj``, in rank order. Objects are pickled here into CPU bytes: torch's own
    ``all_gather_object`` stages them on the current CUDA device when the group could be NCCL."""
    if not distributed():
        return [obj]
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [row[0] for row in all_gather_ints([data.numel()], group)]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:data.numel()] = data
    rows = all_gather_bytes(padded, group).view(len(sizes), -1)
    return [pickle.loads(rows[i, :n].numpy().tobytes()) for i, n in enumerate(sizes)]
