"""The protocol an `IterableDataset` implements so that its data-parallel split can change between steps.

A map-style dataset needs nothing: the strategy reads it through `ElasticSampler`. An iterable dataset cannot be
re-split from outside, so it says how itself:

    set_data_parallel(dp_size, dp_rank, next_global_sample)

From the next sample it yields on, the dataset reads the global stream from global sample ``next_global_sample``
(counted from the start of training: the global batch times the optimizer steps taken) round-robin: rank r of D
yields global samples ``next_global_sample + r``, ``+ r + D``, ``+ r + 2D``, ... The strategy calls it before the
first step (and on a resume) and at every switch; a DataLoader of batch size m then gives rank r micro-batch k of
every window of D*m global samples, the same split `ElasticSampler` makes of a map-style dataset.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from dynatrain.data.corpus import DEFAULT_MAX_CORPUS_BYTES, embedded_corpus
from dynatrain.data.dataset import TokenWindows
from dynatrain.data.sampler import check_rank
from dynatrain.data.tokenizer import ByteTokenizer


@runtime_checkable
class DataParallelIterable(Protocol):
    def set_data_parallel(self, dp_size: int, dp_rank: int, next_global_sample: int) -> None: ...


class IterableTokenWindows(IterableDataset):
    """`TokenWindows` as an endless stream: global sample g is window ``perm_e[g % N]`` of epoch ``e = g // N``
    (``perm_e`` seeded by ``seed + e`` when shuffling). Implements `DataParallelIterable`.

    With DataLoader workers, give ``batch_size`` (the DataLoader's): worker w of W then yields this rank's
    micro-batches w, w + W, ..., the order in which the DataLoader reads its workers' batches.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, shuffle: bool = False, seed: int = 0,
                 batch_size: int | None = None) -> None:
        self.windows = TokenWindows(tokens, seq_len)
        if len(self.windows) == 0:
            raise ValueError(f"{len(tokens)} tokens hold no window of seq_len={seq_len}")
        self.shuffle, self.seed, self.batch_size = shuffle, seed, batch_size
        self.dp_size, self.dp_rank, self.start = 1, 0, 0
        self._version = 0
        self._perm: tuple[int, torch.Tensor] | None = None

    @classmethod
    def embedded(cls, seq_len: int, max_corpus_bytes: int = DEFAULT_MAX_CORPUS_BYTES,
                 cache_dir: str | Path | None = None, **kwargs) -> "IterableTokenWindows":
        """The embedded corpus (this interpreter's standard library, bytes as tokens) as such a stream;
        ``cache_dir``: where its tokens are cached (default ``$DYNATRAIN_CACHE`` or ``~/.cache/dynatrain``)."""
        cache = Path(cache_dir) if cache_dir is not None else None
        return cls(embedded_corpus(ByteTokenizer(), max_corpus_bytes, cache), seq_len, **kwargs)

    def set_data_parallel(self, dp_size: int, dp_rank: int, next_global_sample: int) -> None:
        check_rank(dp_size, dp_rank)
        if next_global_sample < 0:
            raise ValueError(f"next_global_sample must be >= 0, got {next_global_sample}")
        self.dp_size, self.dp_rank, self.start = dp_size, dp_rank, next_global_sample
        self._version += 1

    def window_of(self, global_sample: int) -> int:
        """The window index of a global sample."""
        n = len(self.windows)
        epoch, at = divmod(global_sample, n)
        if not self.shuffle:
            return at
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(n, generator=g))
        return int(self._perm[1][at])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        worker = get_worker_info()
        workers, me = (1, 0) if worker is None else (worker.num_workers, worker.id)
        if workers > 1 and self.batch_size is None:
            raise ValueError("IterableTokenWindows with DataLoader workers needs batch_size= (the DataLoader's)")
        version, k = self._version, 0
        while True:
            if self._version != version:  # re-split between steps: continue from where it now points
                version, k = self._version, 0
            if workers > 1 and (k // self.batch_size) % workers != me:
                k += 1
                continue
            yield self.windows[self.window_of(self.start + self.dp_rank + k * self.dp_size)]
            k += 1
