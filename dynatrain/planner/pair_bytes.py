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
    if len(values):
        # The largest magnitude times the count bounds every partial sum without a temporary array; only values
        # that pass it take the exact test, and only sums that reach 2**53 need int64 accumulation.
        big = max(-int(values.min()), int(values.max()))
        if big * len(values) >= _EXACT and int(np.abs(values).sum()) >= _EXACT:
            out = np.zeros(n, dtype=np.int64)
            np.add.at(out, index, values)
            return out
    out = np.bincount(index, weights=values, minlength=n)
    if out.dtype.kind == "f":  # bincount counts in int64 when there is no weight at all
        np.rint(out, out=out)
    return out.astype(np.int64)


def _small_ids(arrays: tuple[np.ndarray, ...]) -> int:
    """One past the largest id when the ids of ``arrays`` are non-negative and few enough to index an array by
    (process ids); 0 otherwise."""
    size = sum(len(a) for a in arrays)
    if not size:
        return 0
    top = max(int(a.max()) for a in arrays if len(a)) + 1
    low = min(int(a.min()) for a in arrays if len(a))
    return top if low >= 0 and top <= 4 * size + (1 << 16) else 0


def _present(arrays: tuple[np.ndarray, ...], top: int) -> np.ndarray:
    """A mask over ids ``0..top-1``: which occur in ``arrays``."""
    present = np.zeros(top, dtype=bool)
    for a in arrays:
        present[a] = True
    return present


def index_ids(*arrays: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(distinct ids over all ``arrays``, ascending; each array as indices among them): np.unique and its inverse,
    in linear time for process ids (millions of pairs at 16,384 ranks)."""
    top = _small_ids(arrays)
    if top:
        present = _present(arrays, top)
        index = np.cumsum(present) - 1
        return np.flatnonzero(present), [index[a] for a in arrays]
    ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    uniq, inverse = np.unique(ids, return_inverse=True)
    inverse = inverse.reshape(-1)
    cuts = np.cumsum([len(a) for a in arrays])[:-1]
    return uniq, np.split(inverse, cuts)


def dense_ids(*arrays: np.ndarray) -> tuple[int, list[np.ndarray]]:
    """(n, each array as ids below n): the arrays themselves when they are process ids few enough to index an array
    by, else their indices among the distinct ids (`index_ids`)."""
    top = _small_ids(arrays)
    if top:
        return top, list(arrays)
    uniq, index = index_ids(*arrays)
    return len(uniq), index


def sum_by_id(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids ascending, the sum of ``values`` per id), exactly."""
    top = _small_ids((ids,))
    if top:  # process ids: sum straight into an array indexed by id, with no index array of every row
        held = np.flatnonzero(_present((ids,), top))
        return held, sum_by(ids, values, top)[held]
    held, (index,) = index_ids(ids)
    return held, sum_by(index, values, len(held))


def pair_index(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct pairs' senders, receivers, ascending by (src, dst); each row's pair among them): np.unique of
    ``src * top + dst`` with its inverse.

    Where the key and the row number fit one int64 together (process ids always do), they are packed and sorted
    as plain integers: NumPy sorts an int64 array several times faster than it argsorts one, the row numbers in
    the low bits make equal keys keep their row order, and they come out as the stable order itself."""
    n = len(src)
    top = int(max(src.max(initial=-1), dst.max(initial=-1))) + 1
    bits = max(n - 1, 1).bit_length()
    if int(min(src.min(initial=0), dst.min(initial=0))) >= 0 and max(top * top - 1, 0).bit_length() + bits <= 63:
        keys = np.multiply(src, top, dtype=np.int64)  # then in place: every temporary is fresh pages to map
        keys += dst
        keys <<= bits
        keys |= np.arange(n)
        keys.sort()
        order = keys & ((1 << bits) - 1)
        keys >>= bits
    else:
        keys = src.astype(np.int64) * top + dst
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
    first = np.ones(n, dtype=bool)
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    rank = np.cumsum(first)
    rank -= 1
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = rank
    keys = keys[first]
    return keys // max(top, 1), keys % max(top, 1), inverse


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
        self._total: np.ndarray | None = None

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
        """Bytes per pair (computed once: the schedule reads it several times, over millions of pairs)."""
        if self._total is None:
            self._total = self.nbytes.sum(axis=1)
        return self._total

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
