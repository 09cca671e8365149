"""The element hash's weights: ``a(R')`` of a hash row (an odd splitmix64), ``b(c')`` of a hash column (odd,
distinct, below 2**32), and ``b``'s balanced base-128 digits per byte, which turn the inner sum over a hash row into
an int8 matrix product (`dynatrain.check.hashing` says how a tensor is cut into hash rows and columns).

The digits are exact only where `torch._int_mm` sums int8 products exactly in int32; that is probed once a process
(`int_mm_exact`), and where it fails the hash runs elementwise in int64 with ``b`` itself."""

from __future__ import annotations

import torch

from dynatrain.check.int64 import wrap64

ROW = 1 << 14  # units in a hash row at most: at most 64 KiB of bytes, so every digit sum is exact in int32
DIGITS = 9  # balanced base-128 digits, each in [-64, 64), of a byte's weight b(c') * 256**k (below 2**56)
# Columns of the digit table, the last ones zero: int8 products with 16 output columns run 1.3 to 1.6 times faster
# than with 9 on this repository's CPU host (AVX-512 VNNI and AMX kernels fill whole vectors of 16), and the padding
# adds nothing to a sum.
COLUMNS = 16
_M31, _M64 = (1 << 31) - 1, (1 << 64) - 1
_GAMMA, _C1, _C2 = (wrap64(x) for x in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_tables: dict = {}  # `weights`' tables by (unit size, device, digits), and whether `_int_mm` is exact


def row_weight(row: int) -> int:
    """`row_weights` of one row, in Python."""
    z = (row + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return wrap64((z ^ (z >> 31)) | 1)


def row_weights(rows: torch.Tensor) -> torch.Tensor:
    """a(R'): splitmix64 of each hash row (its finaliser, shifts made logical), made odd."""
    z = rows + _GAMMA
    z = (z ^ _srl(z, 30)) * _C1
    z = (z ^ _srl(z, 27)) * _C2
    return (z ^ _srl(z, 31)) | 1


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)


def col_weights(cols: torch.Tensor) -> torch.Tensor:
    """b(c') = 2 * g(c') + 1, ``g`` a bijection of [0, 2**31) (xorshifts and odd multiplications modulo 2**31)."""
    z = cols ^ 0x2545F491
    z = ((z ^ (z >> 16)) * 0x045D9F3B) & _M31
    z = ((z ^ (z >> 15)) * 0x2C1B3C6D) & _M31
    return (z ^ (z >> 16)) * 2 + 1


def weights(unit: int, dev: torch.device, digits: bool):
    """(b of every hash column, int64; the balanced base-128 digits of ``b(c') * 256**k`` for byte ``k`` of a unit
    at ``c'``, int8 of ``[ROW * unit, COLUMNS]``, zero after the first `DIGITS` (None without ``digits``); the
    digits' powers of 128, zero after them), kept."""
    key = (unit, str(dev), digits)
    if key not in _tables:
        b = col_weights(torch.arange(ROW, dtype=torch.int64, device=dev))
        d = None
        if digits:
            w = (b[:, None] << (8 * torch.arange(unit, device=dev))).reshape(-1)
            d = torch.zeros(w.numel(), COLUMNS, dtype=torch.int8, device=dev)
            for j in range(DIGITS):
                digit = ((w + 64) & 127) - 64
                d[:, j] = digit
                w = (w - digit) >> 7
            assert not bool(w.any()), "a weight beyond its digits"
        powers = torch.tensor([128 ** j if j < DIGITS else 0 for j in range(COLUMNS)], dtype=torch.int64, device=dev)
        _tables[key] = (b, d, powers)
    return _tables[key]


def warm_up() -> None:
    """The once-a-process set-up of the hash (the probe of `torch._int_mm`), done now: outside a switch's stall."""
    int_mm_exact()


def int_mm_exact() -> bool:
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
                                        torch.full((k, COLUMNS), digit, dtype=torch.int8))
                    ok = ok and bool((got == k * byte * digit).all())
            for m, k in [(1, 64), (7, 1000), (40, 4100), (300, 257)] if ok else ():
                a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
                w = torch.randint(-64, 64, (k, COLUMNS), dtype=torch.int8, generator=g)
                ok = ok and torch.equal(torch._int_mm(a, w).to(torch.int64), a.to(torch.int64) @ w.to(torch.int64))
        except Exception:  # noqa: BLE001 - any failure of the probe: the elementwise way
            ok = False
        _tables["int_mm"] = ok
    return _tables["int_mm"]
