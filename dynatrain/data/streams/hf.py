"""A Hugging Face `datasets.IterableDataset` (streaming, shuffled with a buffer, split by node), re-split online.

Such a stream has no order independent of the world size: `split_dataset_by_node` gives each rank its own shards (or
every world_size-th example) and `shuffle(buffer_size=...)` mixes them in a buffer of that rank, so the samples of a
step depend on how many ranks read. The adapter keeps reading the splits the run started with: the V *readers* of
the first data-parallel size (reader v is exactly ``split_dataset_by_node(dataset, v, V)``, its epochs following one
another with `set_epoch`), each taking ``q = G / V`` samples a step. Global step s is reader 0's samples
``[s*q, (s+1)*q)``, then reader 1's, ...; rank r of D reads the r-th of D equal slices of that list. Without a switch
(D = V) rank r reads reader r's stream, as the user's own split would; with one, every step still trains on the same
samples (the rule asks less: no sample repeated or skipped in the epoch, the peers of a tp or pp group on one batch).

The price, stated in docs/architecture.md: a rank whose slice starts or ends inside a reader's share reads past the
samples before or after it, and a reader a rank takes over (at a switch, a resume, an admission) is read again from
the start of its current epoch up to the position, since the library's own state drops the shuffle buffer. The
stream is endless (a reader's next epoch follows the last), so the run ends on ``max_steps``.
"""

from __future__ import annotations

import copy
from collections import deque

from torch.utils.data import DataLoader, IterableDataset

from dynatrain.data.sampler import check_rank
from dynatrain.data.streams.protocol import Position, Remake


def adapt_hf(loader: DataLoader, dp_size: int, dp_rank: int, remake: Remake) -> "HFStream | str":
    import datasets

    dataset = loader.dataset
    if not isinstance(dataset, datasets.IterableDataset):
        return f"{type(dataset).__name__} is not a datasets.IterableDataset dynatrain can re-split"
    if loader.num_workers > 0:
        return ("a Hugging Face streaming dataset read by DataLoader workers splits its shards over the workers, and "
                "dynatrain does not re-derive that order: use num_workers=0 (the stream is then read in the "
                "training process), or keep the data-parallel size")
    stream = HFStream(dataset, dp_size, dp_rank)
    stream.loader = remake(loader, stream)
    stream.micro_batch_size = loader.batch_size or 1
    return stream


class _Reader:
    """Reader v of V: its samples counted from the start of training, epochs one after another. ``bounds``: the
    (epoch, first sample) of every epoch start known, shared with the stream's state."""

    def __init__(self, dataset, bounds: list[tuple[int, int]], lookback: int) -> None:
        self.dataset, self.bounds = dataset, bounds
        self.recent: deque = deque(maxlen=max(lookback, 1))  # (position, sample): a prefetch discarded at a switch
        self._restart(0)

    def _restart(self, pos: int) -> None:
        """Read again from the latest epoch start at or before ``pos``."""
        self.epoch, self.start = max((b for b in self.bounds if b[1] <= pos), default=(0, 0), key=lambda b: b[1])
        self.pos, self.it = self.start, None  # pos: the count of the sample the iterator gives next

    def get(self, pos: int):
        for at, sample in self.recent:
            if at == pos:
                return sample
        if pos < self.pos:
            self._restart(pos)
        while self.pos < pos:
            self._next()
        return self._next()

    def _next(self):
        if self.it is None:
            self.dataset.set_epoch(self.epoch)
            self.it = iter(self.dataset)
        try:
            sample = next(self.it)
        except StopIteration:
            if self.pos == self.start:
                raise ValueError(f"a split of the Hugging Face stream has no sample in epoch {self.epoch}: give the "
                                 "dataset at least as many shards or examples as the first data-parallel size") from None
            self.epoch, self.start, self.it = self.epoch + 1, self.pos, None
            if (self.epoch, self.start) not in self.bounds:
                self.bounds.append((self.epoch, self.start))
            return self._next()
        self.recent.append((self.pos, sample))
        self.pos += 1
        return sample


class HFStream(IterableDataset):
    """The samples of this data-parallel rank, step after step, from the first split's readers (see the module)."""

    owns_position = True

    def __init__(self, dataset, dp_size: int, dp_rank: int) -> None:
        check_rank(dp_size, dp_rank)
        distributed = getattr(dataset, "_distributed", None)
        self.split_strategy = getattr(distributed, "strategy", "auto")  # shards or examples, as the user chose
        self.base = copy.copy(dataset)
        self.base._distributed = None  # the user's own split (if any) is replaced by the readers'
        self.reference = dp_size
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.step, self.global_batch = 0, None
        self.known: dict[int, list[tuple[int, int]]] = {}  # reader -> its epochs' (epoch, first sample) seen
        self._readers: dict[int, _Reader] = {}
        self._version = 0
        self.loader: DataLoader | None = None
        self.micro_batch_size = 1

    # ---- the adapter ----------------------------------------------------------------------------------------
    def set_data_parallel(self, dp_size: int, dp_rank: int, position: Position) -> None:
        check_rank(dp_size, dp_rank)
        self.check(dp_size, position.global_batch)
        self.dp_size, self.dp_rank, self.global_batch = dp_size, dp_rank, position.global_batch
        self.step = position.total // position.global_batch
        used = {v for v, _, _ in self.ranges()}
        for v in [v for v in self._readers if v not in used]:
            del self._readers[v]  # its epoch starts stay known
        self._version += 1

    def epoch_samples(self, epoch: int) -> None:
        return None

    def check(self, dp_size: int, global_batch: int) -> None:
        if global_batch % self.reference:
            raise ValueError(f"the global batch of {global_batch} samples does not split over the "
                             f"{self.reference} readers of the Hugging Face stream")
        if global_batch % dp_size:
            raise ValueError(f"the global batch of {global_batch} samples does not split over {dp_size} ranks")

    def state_dict(self) -> dict:
        return {"reference_dp": self.reference,
                "epochs": {str(v): [list(b) for b in sorted(bounds)] for v, bounds in sorted(self.known.items())}}

    def load_state_dict(self, state: dict) -> None:
        """The first split and where each reader's epochs began; the position comes from the steps."""
        self.reference = int(state["reference_dp"])
        self.known = {int(v): [(int(e), int(s)) for e, s in bounds] for v, bounds in state.get("epochs", {}).items()}
        self._readers.clear()

    # ---- reading --------------------------------------------------------------------------------------------
    def ranges(self) -> list[tuple[int, int, int]]:
        """(reader, first, end) of every reader's share of a step this rank reads, in reading order."""
        q = self.global_batch // self.reference
        lo = self.dp_rank * self.global_batch // self.dp_size
        hi = (self.dp_rank + 1) * self.global_batch // self.dp_size
        return [(v, max(lo, v * q) - v * q, min(hi, (v + 1) * q) - v * q)
                for v in range(self.reference) if max(lo, v * q) < min(hi, (v + 1) * q)]

    def _reader(self, v: int) -> _Reader:
        if v not in self._readers:
            from datasets.distributed import split_dataset_by_node

            split = split_dataset_by_node(self.base, rank=v, world_size=self.reference,
                                          strategy=self.split_strategy)
            self._readers[v] = _Reader(split, self.known.setdefault(v, []), self.global_batch // self.reference)
        return self._readers[v]

    def __iter__(self):
        if self.global_batch is None:
            raise RuntimeError("HFStream is read only after set_data_parallel (the strategy calls it at set-up)")
        version, step = self._version, self.step
        while True:
            q = self.global_batch // self.reference
            for v, first, end in self.ranges():
                for j in range(first, end):
                    if self._version != version:
                        break
                    yield self._reader(v).get(step * q + j)
            if self._version != version:  # re-split between steps: go on from where it now points
                version, step = self._version, self.step
                continue
            step += 1
