"""The element hash of the check: a separable sum over a tensor's elements, each indexed by its global position,
so that the sums of any partition of a tensor into local parts add up to the sum of the whole.

A tensor is hashed in units: its elements for 1, 2 and 4 bytes, the two 4-byte halves (low first) of an 8-byte
element (the last dimension doubled). Of the global unit shape, the trailing dimensions are merged while their
product ``width`` stays at most `ROW` (the last one alone if it is longer); each global unit has a row ``R`` (its
flat index over the other dimensions) and a column ``c`` (its flat index over the merged ones), and lies in hash
row ``R' = R * ceil(width / ROW) + c // ROW`` at hash column ``c' = c % ROW``. Its value ``v'`` is its bytes read
as signed base-256 digits (``(v ^ 0x..808080) - 0x..808080`` of its two's complement value ``v``: a bijection onto
2**(8 * size) consecutive integers around 0). The checksum is ``sum a(R') * b(c') * v'`` modulo 2**64 over the
units, ``a`` and ``b`` the odd weights of `dynatrain.check.hash_weights`: bytes and indices enter separately, so the
inner sum over a hash row is a matrix product, the one place where the bytes are read.

Hashing is the whole cost of the check (its all-reduce carries 6 int64 per state): the bytes are read once, by int8
matrix products on a CPU; about 0.03 ms of fixed cost per state, about 0.01 ms per piece of a switch (`PieceSums`:
one matrix product each, their rows weighed together). `bench/check_speed.py` measures the seconds per
GiB on a machine (docs/benchmarks.md, "The check's hash"). On a GPU the elementwise way runs in parts of 4 Mi units
(`bounded_parts`: at most 256 MiB of temporaries, whatever the state's size) with one host transfer per
`PieceSums` (bench/gpu_check/hash_cost.py measures it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager

import torch

from dynatrain.check import hash_weights
from dynatrain.check.hash_weights import COLUMNS, ROW, int_mm_exact, row_weight, row_weights, weights
from dynatrain.check.int64 import wrap64
from dynatrain.check.placement import Index

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
_SPREAD = {1: 0, 2: 0x80, 4: 0x808080}  # v' = (v ^ spread) - spread: the bytes read as signed digits
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
_POOL: dict = {}  # "pool": the process's hashing threads, as (pid, size, pool)
_SPLITS: dict = {}  # a unit shape -> `_hash_split` of it


def indexed_checksum(local: torch.Tensor, indices: Sequence[Index], shape: Sequence[int]) -> int:
    """Sum over the units of ``local`` (the module's docstring) of ``a(R') * b(c') * v'`` modulo 2**64, where entry
    ``(i0, i1, ...)`` of ``local`` is element ``(indices[0][i0], indices[1][i1], ...)`` of a tensor of ``shape``.
    Each unit's term depends on its bits and global index alone, so the sum over any partition of a tensor into
    local parts is the same.

    What it detects (a unit's change ``d = v'_new - v'_old`` is below 2**32 in size, 2**16 for 2-byte dtypes):
    the weights are odd, so a change of one unit (one bit flipped included) always changes the sum; so does an
    exchange of two different units of one hash row (up to `ROW` units of a tensor row; an 8-byte element is
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


def warm_up() -> None:
    """The once-a-process set-up of the hash, done now, outside a switch's stall: the probe of `torch._int_mm`, a
    CPU's weight tables, and a first run of the calls a switch's check makes (a first call of some costs
    milliseconds)."""
    hash_weights.warm_up()
    for unit in _SPREAD:
        weights(unit, torch.device("cpu"), int_mm_exact())
    with PieceSums(1) as sums:
        for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float64):
            sums.add(0, torch.zeros(2, 3, dtype=dtype), [range(2), range(3)], (2, 3))
        sums.totals()


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
    while t > 0 and width * shape[t - 1] <= ROW:
        t, width = t - 1, width * shape[t - 1]
    if t == len(shape):  # a last dimension longer than a hash row: cut into several
        t, width = t - 1, shape[-1]
    rows, cols = _flat(indices[:t], shape[:t]), _flat(indices[t:], shape[t:])
    bits = bits.reshape(len(rows), len(cols))
    cpu = dev.type == "cpu"
    mm = cpu and int_mm_exact()
    b, digits, powers = weights(unit, dev, mm)
    spread = _SPREAD[unit]
    pieces, tasks, sizes = [], [], []
    for x, col, row in _pieces(bits, rows, cols, -(-width // ROW), dev):
        m, k = x.shape
        one = row_weight(row.start) if isinstance(row, range) and len(row) == 1 else None  # a(R') of one row
        row = None if one is not None else row_weights(_as_tensor(row, dev))
        if mm and m >= 16:  # the bytes' digit weights
            w = (digits[col.start * unit:col.stop * unit] if isinstance(col, range) else
                 digits.view(ROW, unit * COLUMNS).index_select(0, col.to(dev)).view(-1, COLUMNS))
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
    once per box. Use as a context (torch held at one intra-op thread inside, as `indexed_checksum` does).

    A piece on a CPU below `_THREADED_BYTES` whose tensor rows each fit one hash row (the boxes a switch moves) is
    read by one int8 matrix product as it is added, leaving its rows' digit sums; `totals` weighs every row of every
    piece by ``a(R')`` at once. The sum is `indexed_checksum`'s, unit for unit: what this saves is the dozen small
    torch calls (row weights, products, sums) per piece that dominate the check of a switch of many small states."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._rows: list[tuple[int, torch.Tensor, Index]] = []  # (state, per row its digit sums, its hash rows)
        self._serial = _serial()
        self.threads = 1

    def __enter__(self) -> PieceSums:
        self.threads = self._serial.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._serial.__exit__(*exc)

    def add(self, i: int, local: torch.Tensor, indices: Sequence[Index], shape: Sequence[int]) -> None:
        """Add the checksum of ``local`` (entries at ``indices`` of a tensor of ``shape``) to state ``i``.
        ValueError: a dtype whose bits have no integer view, or indices that do not fit ``local``'s shape."""
        if local.element_size() not in _BITS:
            raise ValueError(f"dtype {local.dtype}: no integer view of its bits")
        if (tuple(local.shape) or (1,)) != (tuple(map(len, indices)) or (1,)):
            raise ValueError(f"a local box of shape {tuple(local.shape)} at indices of lengths "
                             f"{[len(ix) for ix in indices]}")
        rows = _digit_sums(local, indices, shape)
        if rows is not None:
            self._rows.append((i, *rows))
        else:
            self._pending.append((i, _checksum(local, indices, shape, self.threads)))

    def totals(self) -> list[int]:
        """Per state, its pieces' sum modulo 2**64 (signed): one host transfer per device."""
        out = [0] * self.n
        for i, value in _to_host(self._pending) + _weighed(self._rows, self.n):
            out[i] += value
        return [wrap64(x) for x in out]


def _digit_sums(local: torch.Tensor, indices: Sequence[Index], shape: Sequence[int]):
    """(per row of ``local``'s unit matrix, the digit sums of its units times their column weights, int32; its
    hash rows) by one int8 matrix product, or None where `_checksum` reads it: off a CPU, where `torch._int_mm` is
    not exact, a piece big enough for several threads, a tensor row longer than a hash row."""
    size, n = local.element_size(), local.numel()
    if local.device.type != "cpu" or n == 0 or n * size >= _THREADED_BYTES or not int_mm_exact():
        return None
    if not shape:
        local, indices, shape = local.reshape(1), [range(1)], (1,)
    per, unit = (2, 4) if size == 8 else (1, size)
    units = (*shape[:-1], shape[-1] * per)
    t = _SPLITS.get(units, -1)
    if t == -1:
        if len(_SPLITS) >= 4096:
            _SPLITS.clear()
        t = _SPLITS[units] = _hash_split(units)
    if t is None:
        return None
    last = indices[-1] if per == 1 else _units(indices[-1], per)
    cols = last if t == len(units) - 1 else _flat([*indices[t:-1], last], units[t:])
    rows = indices[0] if t == 1 else _flat(indices[:t], units[:t])
    if local.stride(-1) != 1:  # the bytes of a row must be adjacent for the int8 view
        local = local.contiguous()
    x = local.detach().view(torch.int8)
    if x.dim() != 2 or t != 1:
        x = x.reshape(len(rows), len(cols) * unit)
    digits = weights(unit, local.device, True)[1]
    if isinstance(cols, range):
        return torch._int_mm(x, digits[cols.start * unit:cols.stop * unit]), rows
    # Columns apart (a box of merged trailing dimensions, a strided shard of the last): their bytes' digits gathered.
    return torch._int_mm(x, digits.view(ROW, unit * COLUMNS).index_select(0, cols).view(-1, COLUMNS)), rows


def _hash_split(shape: tuple[int, ...]) -> int | None:
    """How many leading dimensions of a unit ``shape`` index its hash rows (the trailing ones merged while they fit
    one hash row, as `_checksum` cuts it); None where a tensor row spans several hash rows."""
    t, width = len(shape), 1
    while t > 0 and width * shape[t - 1] <= ROW:
        t, width = t - 1, width * shape[t - 1]
    return None if t == len(shape) else t


def _weighed(rows: list[tuple[int, torch.Tensor, Index]], n: int) -> list[tuple[int, int]]:
    """(state, sum) of `_digit_sums`' rows, each weighed by its hash row's ``a(R')``: one pass over all of them."""
    if not rows:
        return []
    powers = weights(1, rows[0][1].device, True)[2]
    z = torch.cat([d for _, d, _ in rows]).to(torch.int64).mul_(powers).sum(1)
    counts = [len(r) for _, _, r in rows]
    if all(isinstance(r, range) for _, _, r in rows):  # every piece's rows a run: one arange for them all
        starts = torch.tensor([r.start for _, _, r in rows], dtype=torch.int64)
        lengths = torch.tensor(counts, dtype=torch.int64)
        index = torch.arange(len(z), dtype=torch.int64) + (starts - lengths.cumsum(0) + lengths).repeat_interleave(
            lengths, output_size=len(z))
    else:
        index = torch.cat([_as_tensor(r, None) for _, _, r in rows])
    states = torch.tensor([i for i, _, _ in rows], dtype=torch.int64).repeat_interleave(
        torch.tensor(counts, dtype=torch.int64), output_size=len(z))
    sums = torch.zeros(n, dtype=torch.int64).index_add_(0, states, z.mul_(row_weights(index)))
    return list(enumerate(sums.tolist()))


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

    pid, size, pool = _POOL.get("pool", (None, 0, None))
    if pid != os.getpid() or size < workers:
        if pid == os.getpid():
            pool.shutdown(wait=False)
        pool = ThreadPoolExecutor(workers, thread_name_prefix="check-hash")
        _POOL["pool"] = (os.getpid(), workers, pool)
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
        for g in range(cols.start // ROW, (cols.stop - 1) // ROW + 1):
            lo, hi = max(cols.start, g * ROW), min(cols.stop, (g + 1) * ROW)
            runs.append((lo - cols.start, hi - cols.start, g, range(lo - g * ROW, hi - g * ROW)))
    else:
        group = cols // ROW
        cuts = [0, *((group[1:] != group[:-1]).nonzero().flatten() + 1).tolist(), len(cols)]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            g = int(group[lo])
            runs.append((lo, hi, g, cols[lo:hi] - g * ROW))
    full = [r for r in runs if r[1] - r[0] == ROW]
    if isinstance(cols, range) and len(rows) < 64 and len(full) > 1:  # few long rows (a vector): batch whole ones
        first, g = full[0][0], full[0][2]
        for i in range(len(rows)):
            yield (bits[i, first:first + len(full) * ROW].view(len(full), ROW), range(ROW),
                   rows[i] * per_row + torch.arange(g, g + len(full), device=rows.device))
            for lo, hi, g2, col in runs:
                if hi - lo != ROW:
                    yield bits[i:i + 1, lo:hi], col, rows[i:i + 1] * per_row + g2
        return
    for lo, hi, g, col in runs:
        yield bits[:, lo:hi], col, rows * per_row + g



def _as_tensor(ix: Index, device) -> torch.Tensor:
    if isinstance(ix, range):
        return torch.arange(ix.start, ix.stop, ix.step, dtype=torch.int64, device=device)
    return ix.to(device=device, dtype=torch.int64)
