"""Bitwise check of a switch that trusts nothing it verifies: each element is indexed by what its tensor says.

`verify` hashes every element with its global flat index, but takes that index (and the replication factor) from
the plan's `Layout`, the very map the engine wrote by: a placement error the layout and the engine share passes.
Here the index of a local element comes from the tensor itself: a DTensor's device mesh, placements and global
shape, through DTensor's own offset arithmetic (`compute_local_shape_and_global_offset`; per-dimension index lists
where a `_StridedShard` leaves them not contiguous); a plain tensor is whole, at offset 0. The replication factor
comes from the tensors too: the number of elements the ranks hold, summed, over the number the state has. Nothing
here imports the layout, the planner or the strategies.

Per state, every rank contributes (all int64, wrapping, so exact modulo 2**64):

- ``sum``: the sum over its elements of ``a(row) * b(column) * value`` (`indexed_checksum`: a separable hash of
  the element's bits and global flat index), or for a scalar or object the 64-bit hash of (name, canonical bytes
  of the value);
- ``held``: the elements it holds (a scalar: 1 holder);
- ``size``, ``knowers``: the state's element count, and 1, from every rank that has the state at all (a rank off
  a DTensor's mesh still knows its shape; one without it, another pipeline stage, does not);
- ``square``: a scalar's hash squared (0 for tensors): with ``k`` holders, ``sum**2 == k * square`` exactly when
  every holder hashed the same value (``sum**2 - k*square = -sum over pairs (h_i - h_j)**2``);
- ``bad``: 1 where the local tensor contradicts its own placements (its shape is not the one they give, a pending
  reduction, a dtype whose bits cannot be read).

`reduce` sums all of it over the ranks in one all-reduce; `differing` / `explain` compare the totals of before and
after: replication ``rep = held / size`` must be a positive integer (or nothing held of an empty state), the size
the same, the scalars' holders in agreement, and ``old_sum * new_rep == new_sum * old_rep`` modulo 2**64.

Cost, measured on this repository's CPU host (2 shared cores of a Xeon with AVX-512 VNNI and AMX, load average 3
to 4 from other jobs): hashing is the whole cost, the all-reduce carries 6 int64 per state. 0.14 s per GiB of
float32 state on one thread (0.08 on two), 0.14 s/GiB of bfloat16, 0.12 of float64: the bytes are read once, by
int8 matrix products (`indexed_checksum`). The per-element hash this replaced (``h = (bits + MIX) * (2 * index +
1); h ^= h >> 29``, `verify`'s, chunked; run from this file as of commit 85d9bc1, alternating with this one) took
1.03 to 1.21 s/GiB of float32 (1.23 on two threads), 1.67 of bfloat16, 0.52 of float64. One of 4 ranks' row
shards of a 125m-like model (12 layers of width 768, 50257 embeddings) with Adam's moments (366 states, 0.43 GiB):
0.10 s, against 0.46 s. Fixed cost
about 0.03 ms per state (1000 small tensors: 0.035 s, against 0.045 s). Once per process, the check that
`torch._int_mm` is exact: 0.04 to 0.15 s; where it is missing or inexact, the elementwise way: 0.46 s/GiB of
float32, 1.2 of bfloat16. A switch sums each rank's share twice (before and after). On a GPU the elementwise way
runs in parts of 4 Mi units (`bounded_parts`: at most 256 MiB of temporaries, whatever the state's size) with one
host transfer per call of `local_sums` or per `PieceSums` (not measured here: bench/gpu_check.sh measures it).
Measure with

    .venv/bin/python -m dynatrain.engine.placed_sums --gib 1 --threads 1     # add --dtype bfloat16, --threads 2

(it hashes a 2-d tensor of that size as `local_sums` does, three times, and prints the best s/GiB and the load).
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from dynatrain.runtime import control_group

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FIELDS = ("sums", "held", "sizes", "knowers", "squares", "bad")


def wrap64(x: int) -> int:
    """``x`` modulo 2**64 as a signed int64: the arithmetic every sum here is exact in."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


# ---------------------------------------------------------------------------------------------------------------
# Where a local tensor lies in its global tensor, by the tensor's own word.


Index = range | torch.Tensor  # the global indices along one dimension: a contiguous range, or any (int64, CPU)


def placed_indices(t: torch.Tensor, memo: dict | None = None) -> list[Index] | None:
    """Per dimension of the global tensor, the global indices of the local tensor's entries along it, from ``t``'s
    own metadata: a DTensor's mesh, placements and shape; a plain tensor whole. A contiguous run is a ``range``,
    anything else (a `_StridedShard` after another shard of its dimension) an int64 tensor. None: this rank is not
    on the DTensor's mesh and holds nothing. A 0-d tensor gives ``[]`` (one element, flat index 0).

    ``memo``: a dict kept for one pass (the meshes stay alive meanwhile), where tensors placed alike (a parameter
    and its optimizer moments) share one answer.

    ValueError: a pending reduction (`Partial`), whose local values are not elements of the tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return [range(n) for n in t.shape]
    mesh, placements, shape = t.device_mesh, tuple(t.placements), tuple(t.shape)
    if memo is None:
        return _placed(mesh, placements, shape)
    key = (id(mesh), placements, shape)
    if key not in memo:
        try:
            memo[key] = _placed(mesh, placements, shape)
        except ValueError as e:
            memo[key] = e
    if isinstance(memo[key], ValueError):
        raise memo[key]
    return memo[key]


def _placed(mesh, placements: tuple, shape: tuple[int, ...]) -> list[Index] | None:
    if mesh.get_coordinate() is None:
        return None
    if any(p.is_partial() for p in placements):
        raise ValueError(f"placements {placements} hold a pending reduction, not the tensor's elements")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    if not _strided(placements):  # Shard gives a contiguous range per dimension: the box is exact
        return [range(o, o + n) for o, n in zip(offset, local_shape)]
    exact = _strided_indices(shape, mesh, placements)
    sizes = tuple(len(ix) for ix in exact)
    firsts = tuple(int(ix[0]) if len(ix) else o for ix, o in zip(exact, offset))
    if sizes != tuple(local_shape) or firsts != tuple(offset):
        raise ValueError(f"torch's offsets of {placements} on {shape}: box {local_shape} at {offset}, indices "
                         f"{sizes} from {firsts}: its two views of one computation disagree")
    return [range(o, o + n) if torch.equal(ix, torch.arange(o, o + n)) else ix
            for ix, o, n in zip(exact, offset, local_shape)]


def _strided(placements) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, _StridedShard) for p in placements)


def _strided_indices(shape, mesh, placements) -> list[torch.Tensor]:
    """Per dimension, every global index (not only the first, which is all `compute_local_shape_and_global_offset`
    returns): a `_StridedShard` after another shard of the same dimension leaves the local entries apart. The same
    left-to-right walk as torch's `_compute_local_shape_and_global_offset`, through its own per-dimension step."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    coord = mesh.get_coordinate()
    index = [torch.arange(n, dtype=torch.int64) for n in shape]
    sharded: set[int] = set()
    for mesh_dim, p in enumerate(placements):
        if not (p.is_shard() or isinstance(p, _StridedShard)):
            continue
        d = p.dim
        size, offsets = _get_shard_size_and_offsets(
            len(index[d]), mesh.size(mesh_dim), coord[mesh_dim], p, index[d] if d in sharded else None, shape[d],
            False)
        index[d] = offsets[:size].to(torch.int64) if size else index[d][:0]
        sharded.add(d)
    return index


# ---------------------------------------------------------------------------------------------------------------
# The element hash: separable odd weights, summed through a matrix product of the bytes.
#
# A tensor is hashed in units: its elements for 1, 2 and 4 bytes, the two 4-byte halves (low first) of an 8-byte
# element (the last dimension doubled). Of the global unit shape, the trailing dimensions are merged while their
# product ``width`` stays at most `_ROW` (the last one alone if it is longer); each global unit has a row ``R`` (its
# flat index over the other dimensions) and a column ``c`` (its flat index over the merged ones), and lies in hash
# row ``R' = R * ceil(width / _ROW) + c // _ROW`` at hash column ``c' = c % _ROW``. Its value ``v'`` is its bytes
# read as signed base-256 digits (``(v ^ 0x..808080) - 0x..808080`` of its two's complement value ``v``: a
# bijection onto 2**(8 * size) consecutive integers around 0). The checksum is ``sum a(R') * b(c') * v'`` modulo
# 2**64 over the units, ``a`` an odd splitmix64 of the hash row, ``b = 2 * g(c') + 1`` with ``g`` a bijection of
# 31 bits (odd, distinct, below 2**32): bytes and indices enter separately, so the inner sum over a hash row is a
# matrix product, the one place where the bytes are read.


_UNITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
_SPREAD = {1: 0, 2: 0x80, 4: 0x808080}  # v' = (v ^ spread) - spread: the bytes read as signed digits
_ROW = 1 << 14  # units in a hash row at most: at most 64 KiB of bytes, so every digit sum below is exact in int32
_DIGITS = 9  # balanced base-128 digits, each in [-64, 64), of a byte's weight b(c') * 256**k (below 2**56)
_M31, _M64 = (1 << 31) - 1, (1 << 64) - 1
_GAMMA, _C1, _C2 = (wrap64(x) for x in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_MM_BYTES = 1 << 20  # bytes per matrix product (rows at least 256): fewer calls, the weights packed less often
_CHUNK = 1 << 15  # units per step of the elementwise way on a CPU (int64 temporaries of 256 KiB)
# On a GPU a tensor is hashed in parts whose temporaries together stay within `_DEVICE_TEMP_BYTES`: the check runs
# after the engine's transfer, outside its memory bound, so it may not build a state-sized copy (a strided piece made
# contiguous, its units widened to int64, per-row weights) beside the state. `_TEMP_PER_UNIT` covers every
# temporary of the elementwise way per unit (the contiguous copy, the xor, the int64 product, and the row weights
# when a row is a single unit); a part is one kernel step, so launches stay few.
_DEVICE_TEMP_BYTES = 256 << 20
_TEMP_PER_UNIT = 64
_CHUNK_ACCELERATOR = _DEVICE_TEMP_BYTES // _TEMP_PER_UNIT
_THREADED_BYTES = 8 << 20  # below this a tensor is hashed on the calling thread alone
_tables: dict = {}  # `_weights`' tables by (unit size, device, digits), and whether `_int_mm` is exact


def indexed_checksum(local: torch.Tensor, indices: Sequence[Index], shape: Sequence[int]) -> int:
    """Sum over the units of ``local`` (the comment above) of ``a(R') * b(c') * v'`` modulo 2**64, where entry
    ``(i0, i1, ...)`` of ``local`` is element ``(indices[0][i0], indices[1][i1], ...)`` of a tensor of ``shape``.
    Each unit's term depends on its bits and global index alone, so the sum over any partition of a tensor into
    local parts is the same.

    What it detects (a unit's change ``d = v'_new - v'_old`` is below 2**32 in size, 2**16 for 2-byte dtypes):
    the weights are odd, so a change of one unit (one bit flipped included) always changes the sum; so does an
    exchange of two different units of one hash row (up to `_ROW` units of a tensor row; an 8-byte element is
    two units), ``(b1 - b2) * d`` being a nonzero integer with fewer than 64 factors 2. Any other change is
    missed with probability at most about ``2**(t - 63)`` if the weights behave as random odd numbers (they are a
    fixed pseudo-random function of the index: a heuristic, not a proof), ``2**t`` the largest power of 2 dividing
    every changed unit's ``d``: ``t < 32``, so at worst 2**-32 (a float32 exchanged with its negation across
    rows), 2**-48 for 2-byte dtypes, about 2**-63 where the low bits differ.

    On a CPU the inner sums are int8 matrix products (`torch._int_mm`) of the bytes with the balanced base-128
    digits of their weights ``b(c') * 256**k``: exact in int32 (64 KiB of bytes times digits below 2**13), checked
    once per process against int64 arithmetic (else, and on a GPU, the same sums elementwise in int64); split over
    ``torch.get_num_threads()`` Python threads, torch held at one intra-op thread meanwhile (an OpenMP barrier on
    an oversubscribed host costs a time slice). Allocates one index per tensor row, never one per element."""
    with _serial() as threads:
        return wrap64(int(_checksum(local, indices, shape, threads).item()))


@contextmanager
def _serial():
    """torch at one intra-op thread while inside (restored after); gives the count it had (the Python threads)."""
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield n
    finally:
        if n > 1:
            torch.set_num_threads(n)


def _checksum(local: torch.Tensor, indices: Sequence[Index], shape: Sequence[int], threads: int = 1,
              bounded: bool | None = None) -> torch.Tensor:
    """`indexed_checksum` as a 0-d int64 tensor on ``local``'s device (no host synchronisation but on a CPU), with
    up to ``threads`` Python threads (a CPU, torch held at one thread by the caller). ``bounded`` (default: off a
    CPU): hashed in `bounded_parts` of `_CHUNK_ACCELERATOR` units, summed on the device; each unit's term depends
    on its bits and global index alone, so the sum is the same bit for bit."""
    dev = local.device
    if local.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=dev)
    if bounded if bounded is not None else dev.type != "cpu":
        per = max(1, local.element_size() // 4)
        parts = [_checksum(part, ix, shape, threads, bounded=False)
                 for part, ix in bounded_parts(local, list(indices), max(1, _CHUNK_ACCELERATOR // per))]
        return parts[0] if len(parts) == 1 else torch.stack(parts).sum()
    size = local.element_size()
    shape, indices = tuple(shape), list(indices)
    if not shape:  # a 0-d tensor: one element at index 0
        local, indices, shape = local.reshape(1), [range(1)], (1,)
    bits = local.detach().contiguous().view(_BITS[size]).view(_UNITS[size])  # 8 bytes: the last dimension doubles
    per = max(1, size // 4)  # units per element
    unit = bits.element_size()
    shape = shape[:-1] + (shape[-1] * per,)
    indices = indices[:-1] + [_units(indices[-1], per)]
    t, width = len(shape), 1  # merge trailing dimensions while they fit in one hash row
    while t > 0 and width * shape[t - 1] <= _ROW:
        t, width = t - 1, width * shape[t - 1]
    if t == len(shape):  # a last dimension longer than a hash row: cut into several
        t, width = t - 1, shape[-1]
    rows, cols = _flat(indices[:t], shape[:t]), _flat(indices[t:], shape[t:])
    bits = bits.reshape(len(rows), len(cols))
    cpu = dev.type == "cpu"
    mm = cpu and _int_mm_exact()
    b, digits, powers = _weights(unit, dev, mm)
    spread = _SPREAD[unit]
    pieces, tasks, sizes = [], [], []
    for x, col, row in _pieces(bits, rows, cols, -(-width // _ROW), dev):
        m, k = x.shape
        one = _row_weight(row.start) if isinstance(row, range) and len(row) == 1 else None  # a(R') of one row
        row = None if one is not None else _row_weights(_as_tensor(row, dev))
        if mm and m >= 16:  # the bytes' digit weights
            w = (digits[col.start * unit:col.stop * unit] if isinstance(col, range) else
                 digits.view(_ROW, unit * _DIGITS).index_select(0, col.to(dev)).view(-1, _DIGITS))
            step, offset = max(256, _MM_BYTES // (k * unit)), None
        else:  # the units' weights, and what v' = (v ^ spread) - spread takes off each row's sum
            w = b[col.start:col.stop] if isinstance(col, range) else b.index_select(0, col.to(dev))
            if one is not None:
                w = w * one
            step, offset = max(1, (_CHUNK if cpu else _CHUNK_ACCELERATOR) // k), w.sum() * spread if spread else None
        pieces.append((x, w, row if one is None else one, offset))
        for r0 in range(0, m, step):
            tasks.append((len(pieces) - 1, r0, min(m, r0 + step)))
            sizes.append((tasks[-1][2] - r0) * k)

    def run(todo) -> torch.Tensor:
        parts = []
        for p, r0, r1 in todo:
            x, w, a, offset = pieces[p]
            if w.dtype == torch.int8:  # per digit, the sum of digit * byte over the bytes, exact; then 128**j
                z = torch._int_mm(x[r0:r1].view(torch.int8), w).to(torch.int64).mul_(powers).sum(1)
            else:
                z = ((x[r0:r1] ^ spread if spread else x[r0:r1]) * w).sum(1)  # promoted to int64 by ``w``
                if offset is not None:
                    z -= offset
            parts.append(z.sum() if isinstance(a, int) else z.mul_(a[r0:r1]).sum())
        return parts[0] if len(parts) == 1 else torch.stack(parts).sum()

    workers = min(threads, len(tasks)) if cpu and sum(sizes) * unit >= _THREADED_BYTES else 1
    if workers <= 1:
        return run(tasks)
    ends, total, done = [], sum(sizes), 0  # contiguous runs of tasks, about equal in units
    for i, s in enumerate(sizes):
        done += s
        if done * workers >= total * (len(ends) + 1):
            ends.append(i + 1)
    starts = [0] + ends[:-1]
    return torch.stack(list(_pool(workers).map(run, [tasks[a:e] for a, e in zip(starts, ends)]))).sum()


def bounded_parts(local: torch.Tensor, indices: list[Index], limit: int, d: int = 0):
    """(view, its indices) of ``local`` cut along its leading dimensions into parts of at most ``limit`` elements
    (a 0-d tensor whole): a part is a run of slices of dimension ``d`` when one slice fits, else each slice is cut
    along the next dimension. Views only: nothing is copied."""
    if local.numel() <= limit or d >= local.dim():
        yield local, indices
        return
    inner = math.prod(local.shape[d + 1:])
    step = 1 if inner > limit else limit // inner
    for i in range(0, local.shape[d], step):
        part = local[(slice(None),) * d + (slice(i, i + step),)]
        ix = indices[:d] + [indices[d][i:i + step]] + indices[d + 1:]
        if inner > limit:
            yield from bounded_parts(part, ix, limit, d + 1)
        else:
            yield part, ix


class PieceSums:
    """Checksums of pieces (any boxes of the states' local tensors) added up per state, kept on their device until
    `totals` reads them all at once: on a GPU, reading each piece's sum as it is made would wait for the device
    once per box. Use as a context (torch held at one intra-op thread inside, as `indexed_checksum` does)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._serial = _serial()
        self.threads = 1

    def __enter__(self) -> PieceSums:
        self.threads = self._serial.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._serial.__exit__(*exc)

    def add(self, i: int, local: torch.Tensor, indices: Sequence[Index], shape: Sequence[int]) -> None:
        """Add the checksum of ``local`` (entries at ``indices`` of a tensor of ``shape``) to state ``i``."""
        self._pending.append((i, _checksum(local, indices, shape, self.threads)))

    def totals(self) -> list[int]:
        """Per state, its pieces' sum modulo 2**64 (signed): one host transfer per device."""
        out = [0] * self.n
        for i, value in _to_host(self._pending):
            out[i] += value
        return [wrap64(x) for x in out]


def _to_host(pending: list[tuple[int, torch.Tensor]]) -> list[tuple[int, int]]:
    """(key, value) of 0-d tensors, read with one transfer per device: the one wait for a GPU's queued hashing."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, x in pending:
        by_device.setdefault(x.device, []).append((i, x))
    return [(i, value) for items in by_device.values()
            for (i, _), value in zip(items, torch.stack([x for _, x in items]).tolist())]


def _pool(workers: int):
    """A pool of at least ``workers`` threads kept for the process (a new thread's first matrix product costs about
    1 ms), made anew in a forked child (whose copy has no threads)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    pid, size, pool = _tables.get("pool", (None, 0, None))
    if pid != os.getpid() or size < workers:
        if pid == os.getpid():
            pool.shutdown(wait=False)
        pool = ThreadPoolExecutor(workers, thread_name_prefix="placed-sums")
        _tables["pool"] = (os.getpid(), workers, pool)
    return pool


def _units(ix: Index, per: int) -> Index:
    """The unit indices of elements ``ix`` along the last dimension, ``per`` units an element."""
    if per == 1:
        return ix
    if isinstance(ix, range) and ix.step == 1:
        return range(ix.start * per, ix.stop * per)
    ix = _as_tensor(ix, ix.device if isinstance(ix, torch.Tensor) else None)
    return (ix[:, None] * per + torch.arange(per, device=ix.device)).reshape(-1)


def _flat(indices: Sequence[Index], shape: Sequence[int]) -> Index:
    """The flat indices in ``shape`` of the entries of the product of ``indices`` (row-major): a range while they
    are contiguous, else an int64 tensor (on the first index tensor's device)."""
    out: Index = range(1)
    for ix, n in zip(indices, shape):
        if isinstance(out, range) and isinstance(ix, range) and ix.step == 1 and (
                len(out) == 1 or (ix.start == 0 and ix.stop == n)):
            out = range(out.start * n + ix.start, (out.stop - 1) * n + ix.stop)
        else:
            dev = ix.device if isinstance(ix, torch.Tensor) else out.device if isinstance(out, torch.Tensor) else None
            out = (_as_tensor(out, dev)[:, None] * n + _as_tensor(ix, dev)[None, :]).reshape(-1)
    return out


def _pieces(bits: torch.Tensor, rows: Index, cols: Index, per_row: int, dev):
    """(matrix of units, their hash columns, each matrix row's hash row) covering ``bits``, whose rows are tensor
    rows ``rows`` and columns ``cols``, each tensor row ``per_row`` hash rows."""
    if per_row == 1:
        yield bits, cols, rows
        return
    rows = _as_tensor(rows, dev)
    runs = []  # (first, end) local columns of one hash row, its index within the tensor row, its hash columns
    if isinstance(cols, range):
        for g in range(cols.start // _ROW, (cols.stop - 1) // _ROW + 1):
            lo, hi = max(cols.start, g * _ROW), min(cols.stop, (g + 1) * _ROW)
            runs.append((lo - cols.start, hi - cols.start, g, range(lo - g * _ROW, hi - g * _ROW)))
    else:
        group = cols // _ROW
        cuts = [0, *((group[1:] != group[:-1]).nonzero().flatten() + 1).tolist(), len(cols)]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            g = int(group[lo])
            runs.append((lo, hi, g, cols[lo:hi] - g * _ROW))
    full = [r for r in runs if r[1] - r[0] == _ROW]
    if isinstance(cols, range) and len(rows) < 64 and len(full) > 1:  # few long rows (a vector): batch whole ones
        first, g = full[0][0], full[0][2]
        for i in range(len(rows)):
            yield (bits[i, first:first + len(full) * _ROW].view(len(full), _ROW), range(_ROW),
                   rows[i] * per_row + torch.arange(g, g + len(full), device=rows.device))
            for lo, hi, g2, col in runs:
                if hi - lo != _ROW:
                    yield bits[i:i + 1, lo:hi], col, rows[i:i + 1] * per_row + g2
        return
    for lo, hi, g, col in runs:
        yield bits[:, lo:hi], col, rows * per_row + g


def _row_weight(row: int) -> int:
    """`_row_weights` of one row, in Python."""
    z = (row + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return wrap64((z ^ (z >> 31)) | 1)


def _row_weights(rows: torch.Tensor) -> torch.Tensor:
    """a(R'): splitmix64 of each hash row (its finaliser, shifts made logical), made odd."""
    z = rows + _GAMMA
    z = (z ^ _srl(z, 30)) * _C1
    z = (z ^ _srl(z, 27)) * _C2
    return (z ^ _srl(z, 31)) | 1


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)


def _col_weights(cols: torch.Tensor) -> torch.Tensor:
    """b(c') = 2 * g(c') + 1, ``g`` a bijection of [0, 2**31) (xorshifts and odd multiplications modulo 2**31)."""
    z = cols ^ 0x2545F491
    z = ((z ^ (z >> 16)) * 0x045D9F3B) & _M31
    z = ((z ^ (z >> 15)) * 0x2C1B3C6D) & _M31
    return (z ^ (z >> 16)) * 2 + 1


def _weights(unit: int, dev: torch.device, digits: bool):
    """(b of every hash column, int64; the balanced base-128 digits of ``b(c') * 256**k`` for byte ``k`` of a unit
    at ``c'``, int8 of ``[_ROW * unit, _DIGITS]`` (None without ``digits``); the digits' powers of 128), kept."""
    key = (unit, str(dev), digits)
    if key not in _tables:
        b = _col_weights(torch.arange(_ROW, dtype=torch.int64, device=dev))
        d = None
        if digits:
            w = (b[:, None] << (8 * torch.arange(unit, device=dev))).reshape(-1)
            d = torch.empty(w.numel(), _DIGITS, dtype=torch.int8, device=dev)
            for j in range(_DIGITS):
                digit = ((w + 64) & 127) - 64
                d[:, j] = digit
                w = (w - digit) >> 7
            assert not bool(w.any()), "a weight beyond its digits"
        powers = torch.tensor([128 ** j for j in range(_DIGITS)], dtype=torch.int64, device=dev)
        _tables[key] = (b, d, powers)
    return _tables[key]


def warm_up() -> None:
    """The once-a-process set-up of the hash (the probe of `torch._int_mm`), done now: outside a switch's stall."""
    _int_mm_exact()


def _int_mm_exact() -> bool:
    """Whether `torch._int_mm` on this CPU sums int8 products exactly in int32 for the shapes and values hashed
    (its extremes: bytes -128 and 127 against digits -64 and 63 over 64 KiB rows; random ones), once a process."""
    if "int_mm" not in _tables:
        try:
            ok = hasattr(torch, "_int_mm")
            g = torch.Generator().manual_seed(11)
            k = 1 << 16
            for byte in (-128, 127) if ok else ():
                for digit in (-64, 63):
                    got = torch._int_mm(torch.full((64, k), byte, dtype=torch.int8),
                                        torch.full((k, _DIGITS), digit, dtype=torch.int8))
                    ok = ok and bool((got == k * byte * digit).all())
            for m, k in [(1, 64), (7, 1000), (40, 4100), (300, 257)] if ok else ():
                a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
                w = torch.randint(-64, 64, (k, _DIGITS), dtype=torch.int8, generator=g)
                ok = ok and torch.equal(torch._int_mm(a, w).to(torch.int64), a.to(torch.int64) @ w.to(torch.int64))
        except Exception:  # noqa: BLE001 - any failure of the probe: the elementwise way
            ok = False
        _tables["int_mm"] = ok
    return _tables["int_mm"]


def _as_tensor(ix: Index, device) -> torch.Tensor:
    if isinstance(ix, range):
        return torch.arange(ix.start, ix.stop, ix.step, dtype=torch.int64, device=device)
    return ix.to(device=device, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# Scalars and objects.


def _canonical(v, out: bytearray, depth: int = 0) -> None:
    """Type-tagged bytes of ``v``, the same for equal values on every rank: dict keys sorted by their bytes, lists
    and tuples alike, tensors as dtype, shape and raw bits, floats by their bits."""
    if depth > 64:
        raise ValueError("an object nested deeper than 64 levels")
    if v is None or isinstance(v, bool):
        out += b"N" if v is None else (b"T" if v else b"F")
    elif isinstance(v, int):
        out += b"i" + str(v).encode() + b";"
    elif isinstance(v, float):
        out += b"f" + struct.pack("<d", v)
    elif isinstance(v, complex):
        out += b"c" + struct.pack("<dd", v.real, v.imag)
    elif isinstance(v, str):
        b = v.encode("utf-8", "surrogatepass")
        out += b"s" + str(len(b)).encode() + b":" + b
    elif isinstance(v, (bytes, bytearray)):
        out += b"b" + str(len(v)).encode() + b":" + bytes(v)
    elif isinstance(v, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(v, DTensor):  # its local part, with where that part lies
            out += b"D" + repr((tuple(v.shape), tuple(str(p) for p in v.placements))).encode()
            v = v.to_local()
        t = v.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        out += b"t" + repr((str(t.dtype), tuple(t.shape))).encode() + str(raw.numel()).encode() + b":"
        out += raw.numpy().tobytes()
    elif isinstance(v, Mapping):
        items = []
        for key, value in v.items():
            kb, vb = bytearray(), bytearray()
            _canonical(key, kb, depth + 1)
            _canonical(value, vb, depth + 1)
            items.append((bytes(kb), bytes(vb)))
        out += b"{" + str(len(items)).encode() + b":"
        for kb, vb in sorted(items):
            out += kb + vb
        out += b"}"
    elif isinstance(v, (list, tuple)):
        out += b"[" + str(len(v)).encode() + b":"
        for x in v:
            _canonical(x, out, depth + 1)
        out += b"]"
    elif isinstance(v, (set, frozenset)):
        parts = []
        for x in v:
            b = bytearray()
            _canonical(x, b, depth + 1)
            parts.append(bytes(b))
        out += b"<" + str(len(parts)).encode() + b":" + b"".join(sorted(parts)) + b">"
    elif type(v).__module__ == "numpy":
        import numpy as np

        a = np.ascontiguousarray(np.asarray(v))
        out += b"n" + repr((a.dtype.str, a.shape)).encode() + b":" + a.tobytes()
    else:  # an object of the user's: its type and repr, memory addresses left out
        text = re.sub(r"0x[0-9a-fA-F]+", "0x", repr(v))
        out += b"o" + f"{type(v).__module__}.{type(v).__qualname__}".encode() + b"|" + text.encode() + b";"


def canonical_bytes(v) -> bytes:
    """The bytes a scalar or object is hashed by (see `_canonical`)."""
    out = bytearray()
    _canonical(v, out)
    return bytes(out)


def scalar_hash(name: str, value) -> int:
    """The 64-bit hash (a signed int64, odd) one holder of scalar state ``name`` contributes."""
    d = hashlib.blake2b(digest_size=8, person=b"dynatrain-sums")
    d.update(name.encode())
    d.update(b"\0")
    d.update(canonical_bytes(value))
    return wrap64(int.from_bytes(d.digest(), "little") | 1)


# ---------------------------------------------------------------------------------------------------------------
# Per-state sums: local, reduced, compared.


@dataclass
class StateSums:
    """Per state of ``names`` (one agreed order on every rank): this rank's contributions, or after `reduce` the
    totals over the ranks. ``problems``: why this rank marked a state bad (this rank's own, not reduced)."""

    names: tuple[str, ...]
    sums: list[int]
    held: list[int]  # elements held (a scalar: holders)
    sizes: list[int]  # sum of the state's element count over the ranks that have it (a scalar: 1 each)
    knowers: list[int]  # ranks that have it
    squares: list[int]  # a scalar: its hash squared; a tensor: 0
    bad: list[int]  # ranks whose local tensor contradicts its placements
    problems: dict[str, str] = field(default_factory=dict)

    @classmethod
    def empty(cls, names: Sequence[str]) -> StateSums:
        n = len(names)
        return cls(tuple(names), *([0] * n for _ in _FIELDS))

    def vector(self) -> list[int]:
        return [wrap64(x) for f in _FIELDS for x in getattr(self, f)]

    @classmethod
    def from_vector(cls, names: tuple[str, ...], values: Sequence[int], problems=None) -> StateSums:
        n = len(names)
        parts = [list(values[i * n:(i + 1) * n]) for i in range(len(_FIELDS))]
        return cls(names, *parts, problems=dict(problems or {}))


def local_sums(tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, object], names: Sequence[str]) -> StateSums:
    """This rank's contributions to every state of ``names``: a tensor (DTensor or plain) of ``tensors`` by the
    elements it holds where its own metadata places them, a value of ``scalars`` (a 0-d tensor, a number, a
    scheduler's ``state_dict()``, any JSON-like object) by one holder's hash; 0 for a name this rank has not.
    A local tensor that contradicts its placements is counted ``bad`` (reported by `explain` on every rank, after
    `reduce`) rather than raised, so no rank leaves the others waiting in the all-reduce."""
    both = set(tensors) & set(scalars)
    if both:
        raise ValueError(f"states given both as tensors and as scalars: {sorted(both)[:5]}")
    out = StateSums.empty(names)
    with _serial() as threads:
        _hash_states(out, tensors, scalars, threads)
    return out


def _hash_states(out: StateSums, tensors, scalars, threads: int) -> None:
    memo: dict = {}
    pending: list[tuple[int, torch.Tensor]] = []  # (state, its sum on the device): one transfer for all at the end
    for i, name in enumerate(out.names):
        if name in scalars:
            h = scalar_hash(name, scalars[name])
            out.sums[i], out.held[i], out.sizes[i], out.knowers[i], out.squares[i] = h, 1, 1, 1, wrap64(h * h)
            continue
        t = tensors.get(name)
        if t is None:
            continue
        out.sizes[i], out.knowers[i] = t.numel(), 1
        try:
            indices = placed_indices(t, memo)
            if indices is None:  # off the DTensor's mesh: holds nothing
                continue
            local = _local(t)
            want = tuple(len(ix) for ix in indices)
            if tuple(local.shape) != want:
                raise ValueError(f"local shape {tuple(local.shape)}, its placements give {want}")
            if local.element_size() not in _BITS:
                raise ValueError(f"dtype {local.dtype}: no integer view of its bits")
            pending.append((i, _checksum(local, indices, tuple(t.shape), threads)))
            out.held[i] = local.numel()
        except ValueError as e:
            out.bad[i] = 1
            out.problems[name] = str(e)
    for i, value in _to_host(pending):
        out.sums[i] = wrap64(value)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def reduce(sums: StateSums, group=None) -> StateSums:
    """``sums`` summed over the ranks of the control group ``group`` (one all-reduce of ``6 * len(names)`` int64s,
    `dynatrain.runtime.control_group`); as it is without an initialised process group."""
    return StateSums.from_vector(sums.names, control_group.all_reduce_ints(sums.vector(), group), sums.problems)


def reduce_pair(old: StateSums, new: StateSums, group=None) -> tuple[StateSums, StateSums]:
    """`reduce` of both sides in one all-reduce (the switch can keep its local sums of before until after)."""
    v, n = control_group.all_reduce_ints(old.vector() + new.vector(), group), len(_FIELDS) * len(old.names)
    return StateSums.from_vector(old.names, v[:n], old.problems), StateSums.from_vector(new.names, v[n:],
                                                                                       new.problems)


def _side(s: StateSums, i: int) -> tuple[int, int, str | None]:
    """(element count, replication, what is wrong or None) of state ``i`` of a reduced side."""
    held, size, knowers, square, bad = s.held[i], s.sizes[i], s.knowers[i], s.squares[i], s.bad[i]
    if bad:
        why = s.problems.get(s.names[i])
        return 0, 0, f"{bad} rank(s) hold a local tensor that contradicts its own placements" + (
            f" (here: {why})" if why else "")
    if size < 0 or size % knowers:
        return 0, 0, f"the ranks that have it disagree on its size ({size} over {knowers})"
    numel = size // knowers
    if numel == 0:
        return 0, 1, None if held == 0 else f"{held} elements held of an empty state"
    if held <= 0 or held % numel:
        return numel, 0, f"{held} elements held of {numel}: not a whole number of copies"
    if square and wrap64(s.sums[i] * s.sums[i] - held * square):
        return numel, 0, f"its {held} holders do not all hold the same value"
    return numel, held // numel, None


def explain(old: StateSums, new: StateSums) -> dict[str, str]:
    """Per state that differs between the reduced sums of before (``old``) and after (``new``), why; empty when
    every state is the same bit for bit (up to the hash) and consistently held on both sides."""
    if old.names != new.names:
        raise ValueError("old and new sums are over different state names: take both over one agreed list")
    out: dict[str, str] = {}
    for i, name in enumerate(old.names):
        known = old.knowers[i] > 0, new.knowers[i] > 0
        if known != (True, True):
            if known != (False, False):
                out[name] = "held by nobody " + ("before" if known[1] else "after") + " the switch"
            continue
        (a, p, why_a), (b, q, why_b) = _side(old, i), _side(new, i)
        if why_a or why_b:
            out[name] = "; ".join(f"{when}: {why}" for when, why in (("before", why_a), ("after", why_b)) if why)
        elif a != b:
            out[name] = f"{a} elements before, {b} after"
        elif wrap64(old.sums[i] * q) != wrap64(new.sums[i] * p):
            out[name] = "values differ"
    return out


def differing(old: StateSums, new: StateSums) -> list[str]:
    """Names of the states `explain` reports, in ``names`` order."""
    return list(explain(old, new))


def compare(old: StateSums, new: StateSums, group=None) -> dict[str, str]:
    """Local sums of before and after, reduced over the control group ``group`` in one all-reduce and explained
    (empty: bitwise equal)."""
    return explain(*reduce_pair(old, new, group))


# ---------------------------------------------------------------------------------------------------------------
# What a live module and optimizer hold, named as the switch's capture names it.

PARAM_GROUP = "#param_group"
SCHEDULER = "#scheduler"


def _read_only(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's detach goes through DTensor's dispatch (about 30 us each, 3,000 per check of a small model); the
    # switch's check reads values under no_grad, so a DTensor is taken as it is.
    from torch.distributed.tensor import DTensor

    return t if isinstance(t, DTensor) else t.detach()


def module_state_tensors(module: torch.nn.Module, optimizer=None, schedulers: Sequence = (),
                         param_groups: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """(tensors, scalars) of ``module`` and ``optimizer`` as the switch's capture names them: each parameter by
    its name, each optimizer tensor of a parameter (not 0-d) as ``<param>.<key>``, each buffer by its name (the
    tensors themselves, DTensors not made local); every other optimizer entry (``step``, numbers, None) as a
    scalar ``<param>.<key>``. With ``param_groups``, each optimizer group's hyper-parameters as the scalar
    ``#param_group.<i>`` (its parameters by name); each of ``schedulers`` (torch LR schedulers) as
    ``#scheduler.<i>``, its ``state_dict()``."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, object] = {}
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names[id(p)] = name
        tensors[name] = _read_only(p)
        state = optimizer.state.get(p) if optimizer is not None else None
        for key, v in (state or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                tensors[f"{name}.{key}"] = _read_only(v)
            else:
                scalars[f"{name}.{key}"] = v
    for name, b in module.named_buffers():
        tensors[name] = _read_only(b)
    if optimizer is not None and param_groups:
        for i, g in enumerate(optimizer.param_groups):
            scalars[f"{PARAM_GROUP}.{i}"] = {
                k: [names.get(id(p), "?") for p in v] if k == "params" else v for k, v in g.items()}
    for i, s in enumerate(schedulers):
        scalars[f"{SCHEDULER}.{i}"] = s.state_dict()
    return tensors, scalars


def all_names(tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, object], group=None) -> tuple[str, ...]:
    """The sorted union of every rank's state names over the control group ``group``: the agreed order where ranks
    have different states (pipeline stages)."""
    every = control_group.all_gather_object(sorted({*tensors, *scalars}), group)
    return tuple(sorted({n for names in every for n in names}))


def _measure(gib: float, threads: int, dtype: str, repeats: int) -> list[float]:
    """Seconds per GiB that `indexed_checksum` takes on a 2-d tensor of ``gib`` GiB, per repetition (`__main__`)."""
    import time

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    elem = torch.tensor([], dtype=dt).element_size()
    cols = 4096
    rows = max(1, int(gib * (1 << 30)) // (elem * cols))
    t = torch.randn(rows, cols).to(dt)
    idx = [range(rows), range(cols)]
    indexed_checksum(t[:8], [range(8), idx[1]], (rows, cols))  # warm up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        indexed_checksum(t, idx, (rows, cols))
        out.append((time.perf_counter() - start) / (t.numel() * elem / (1 << 30)))
    return out


if __name__ == "__main__":
    import argparse
    import os

    ap = argparse.ArgumentParser(description="seconds per GiB the placed checksum takes on this machine")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs = _measure(args.gib, args.threads, args.dtype, args.repeats)
    print(f"{min(runs):.2f} s/GiB best of {len(runs)} ({', '.join(f'{r:.2f}' for r in runs)}; {args.dtype}, "
          f"{args.threads} thread(s), {math.ceil(args.gib * 1024)} MiB, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs)")
