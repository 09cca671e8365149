"""Sums modulo 2**64: every checksum of the check is exact in this arithmetic, whatever the order it is added in."""


def wrap64(x: int) -> int:
    """``x`` modulo 2**64 as a signed int64 (the value an int64 all-reduce gives)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x
