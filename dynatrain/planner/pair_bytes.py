"""Bytes per ordered (sender, receiver) pair and itemsize, held as arrays.

A 405B switch at 16,384 ranks has up to a few million communicating pairs: a dict of tuples per pair would cost
seconds to build, so the table and the schedule pass arrays around, and this mapping only turns an entry into
``((itemsize, bytes), ...)`` when someone reads it (tests, small plans).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

_EXACT = 2 ** 53  # float64 holds every integer below this: bincount's float sums stay exact


def sum_by(index: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """``out[i] = sum(values[index == i])`` in int64, exactly."""
    if len(values) and int(np.abs(values).sum()) >= _EXACT:
        out = np.zeros(n, dtype=np.int64)
        np.add.at(out, index, values)
        return out
    return np.rint(np.bincount(index, weights=values, minlength=n)).astype(np.int64)


class PairBytes(Mapping):
    """(src, dst) -> ((itemsize, bytes), ...), itemsize descending, zero entries left out; pairs ascending.

    ``src``, ``dst``: the pairs (each moves at least one byte); ``sizes``: itemsizes, descending;
    ``nbytes[i, j]``: bytes of itemsize ``sizes[j]`` pair ``i`` moves; ``pair_id``: an index per pair that the
    caller chose (the route table's global pair index), carried along."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, nbytes: np.ndarray,
                 pair_id: np.ndarray | None = None) -> None:
        self.src = np.asarray(src, dtype=np.int64)
        self.dst = np.asarray(dst, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.nbytes = np.asarray(nbytes, dtype=np.int64).reshape(len(self.src), len(self.sizes))
        self.pair_id = np.arange(len(self.src)) if pair_id is None else np.asarray(pair_id, dtype=np.int64)
        self._where: dict | None = None

    @classmethod
    def from_dict(cls, pair_bytes: Mapping) -> "PairBytes":
        """Any mapping of the same form; pairs that move nothing are dropped (they need no round)."""
        if isinstance(pair_bytes, PairBytes):
            return pair_bytes
        sizes = sorted({size for segs in pair_bytes.values() for size, _ in segs}, reverse=True)
        col = {size: j for j, size in enumerate(sizes)}
        pairs = [p for p in sorted(pair_bytes) if sum(b for _, b in pair_bytes[p])]
        out = np.zeros((len(pairs), len(sizes)), dtype=np.int64)
        for i, p in enumerate(pairs):
            for size, b in pair_bytes[p]:
                out[i, col[size]] += b
        src = np.array([p[0] for p in pairs], dtype=np.int64)
        dst = np.array([p[1] for p in pairs], dtype=np.int64)
        return cls(src, dst, np.array(sizes, dtype=np.int64), out)

    @property
    def total(self) -> np.ndarray:
        """Bytes per pair."""
        return self.nbytes.sum(axis=1)

    def _index(self) -> dict:
        if self._where is None:
            self._where = {(s, d): i for i, (s, d) in enumerate(zip(self.src.tolist(), self.dst.tolist()))}
        return self._where

    def __len__(self) -> int:
        return len(self.src)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self.src.tolist(), self.dst.tolist()))

    def __getitem__(self, pair) -> tuple[tuple[int, int], ...]:
        i = self._index()[pair]
        return tuple((size, b) for size, b in zip(self.sizes.tolist(), self.nbytes[i].tolist()) if b)
