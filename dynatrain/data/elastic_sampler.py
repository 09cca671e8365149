"""`ElasticSampler`: `DistributedSampler`'s order, with a data-parallel split that may change between steps.

An epoch is the list `DistributedSampler` would split: the dataset's indices (or a user sampler's, listed each
epoch as Lightning's `DistributedSamplerWrapper` does), shuffled with `seed + epoch`, padded or cut to a multiple
of the *reference* data-parallel size D0 (the one the run started with) exactly as `DistributedSampler` does.
Global step s of the epoch is the window `order[s*G : (s+1)*G]` (the last one may be shorter), and rank r of D
reads `window[r::D]`. For D = D0 that is `order[r::D0]` micro-batch after micro-batch, `DistributedSampler`'s own
split; for any other D, the same samples form each global step. A switch therefore changes who reads a sample,
never which samples a step trains on, nor where the epoch ends.

The split is read lazily at the start of each step, so a change made between optimizer steps applies to the next
step a running iterator starts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler

from dynatrain.data.sampler import check_rank


def distributed_length(n: int, dp_size: int, drop_last: bool) -> int:
    """How many of ``n`` samples `DistributedSampler` splits over ``dp_size`` ranks: padded to a multiple of it, or
    cut to one with ``drop_last``."""
    per_rank = math.ceil((n - dp_size) / dp_size) if drop_last and n % dp_size else math.ceil(n / dp_size)
    return per_rank * dp_size


def distributed_order(indices: list[int], dp_size: int, shuffle: bool, seed: int, epoch: int,
                      drop_last: bool) -> list[int]:
    """The whole list `DistributedSampler(num_replicas=dp_size, shuffle, seed, drop_last)` splits in ``epoch``:
    rank r reads ``order[r::dp_size]`` of it."""
    n = len(indices)
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = [indices[i] for i in torch.randperm(n, generator=g).tolist()]
    else:
        order = list(indices)
    total = distributed_length(n, dp_size, drop_last)
    if total <= n:
        return order[:total]
    pad = total - n
    if pad <= n:
        return order + order[:pad]
    return order + (order * math.ceil(pad / n))[:pad]


class ElasticSampler(DistributedSampler):
    """This data-parallel rank's indices of a map-style dataset, step by step, for `DataLoader(batch_size=m)`.

    A subclass of `DistributedSampler`, so that Lightning neither wraps nor replaces it.

    Args:
        source: the dataset (its indices ``range(len)``), or a sampler whose indices are listed each epoch.
        micro_batch_size: the DataLoader's batch size, kept through every switch.
        global_batch_size: samples per optimizer step over all data-parallel ranks (a training sampler); None for
            an evaluation sampler, whose split follows the current size each time it is iterated.
        dp_size, dp_rank: the split it starts with; ``dp_size`` is also the reference size of the padding.
        shuffle, seed, drop_last: as `DistributedSampler`'s.
        max_samples: at most this many samples of an epoch (Lightning's ``limit_train_batches``, in samples).
    """

    def __init__(self, source: Sized | Sampler, micro_batch_size: int, global_batch_size: int | None,
                 dp_size: int, dp_rank: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 max_samples: int | None = None) -> None:
        check_rank(dp_size, dp_rank)
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        self.source = source
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.reference_dp = dp_size
        self.max_samples = max_samples
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self._epoch = 0
        self._next_step = 0  # the step of the epoch the iterator starts next
        self._version = 0  # bumped by every jump of the position, so a running iterator notices it
        self._base = (0, 0)  # (step, micro-batches this rank read before it) where the current split began
        self._order: tuple[int, list[int]] | None = None
        self.trace: list[int] | None = None  # when a list: every index handed out is appended (a check's record)
        super().__init__(_Indexed(source), num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._sync_base_fields()

    @property
    def training(self) -> bool:
        return self.global_batch_size is not None

    def _sync_base_fields(self) -> None:
        # DistributedSampler's public fields, kept truthful for code that reads them.
        self.num_replicas, self.rank = self.dp_size, self.dp_rank
        self.num_samples = len(self)
        self.total_size = self.num_samples * self.dp_size

    # -- the epoch ------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch = value

    def set_epoch(self, epoch: int) -> None:
        """A new epoch starts at its first step; the same epoch again (a resume) keeps the position."""
        forward = getattr(self.source, "set_epoch", None)
        if isinstance(self.source, Sampler) and callable(forward):
            forward(epoch)  # as Lightning's DistributedSamplerWrapper does for the sampler it wraps
        if epoch != self._epoch:
            self._epoch = epoch
            self._next_step, self._base = 0, (0, 0)
            self._version += 1
            self._sync_base_fields()

    def order(self, epoch: int | None = None) -> list[int]:
        """The epoch's samples in global order (the list `DistributedSampler` splits), identical on every rank."""
        epoch = self._epoch if epoch is None else epoch
        reference = self.reference_dp if self.training else self.dp_size
        key = (epoch, reference)
        if self._order is None or self._order[0] != key:
            indices = list(self.source) if isinstance(self.source, Sampler) else list(range(len(self.source)))
            order = distributed_order(indices, reference, self.shuffle, self.seed, epoch, self.drop_last)
            if self.max_samples is not None and self.training:
                order = order[: self.max_samples]
            self._order = (key, order)
        return self._order[1]

    def epoch_length(self) -> int:
        if isinstance(self.source, Sampler) and not isinstance(self.source, Sized):
            return len(self.order())
        reference = self.reference_dp if self.training else self.dp_size
        length = distributed_length(len(self.source), reference, self.drop_last)
        return length if self.max_samples is None or not self.training else min(length, self.max_samples)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in an epoch, the last of them possibly short."""
        return math.ceil(self.epoch_length() / self.global_batch_size)

    def step_window(self, step: int) -> tuple[int, int]:
        length = self.epoch_length()
        return min(step * self.global_batch_size, length), min((step + 1) * self.global_batch_size, length)

    def global_batch(self, step: int, epoch: int | None = None) -> list[int]:
        """The sample indices of the epoch's step ``step``, in global order."""
        start, end = self.step_window(step)
        return self.order(epoch)[start:end]

    def rank_indices(self, step: int, dp_size: int | None = None, dp_rank: int | None = None) -> list[int]:
        """What rank ``dp_rank`` of ``dp_size`` reads at the epoch's step ``step``."""
        size = self.dp_size if dp_size is None else dp_size
        rank = self.dp_rank if dp_rank is None else dp_rank
        return self.global_batch(step)[rank::size]

    # -- the split ------------------------------------------------------------------------------

    def accumulation_for(self, dp_size: int) -> int:
        """Micro-batches per rank per optimizer step on ``dp_size`` ranks, or a ValueError saying what to change."""
        G, m = self.global_batch_size, self.micro_batch_size
        if G % (dp_size * m):
            sizes = [d for d in range(1, G // m + 1) if (G // m) % d == 0]
            raise ValueError(
                f"the global batch of {G} samples (dataloader batch_size={m} x {self.reference_dp} data-parallel "
                f"ranks x accumulate_grad_batches={G // (m * self.reference_dp)}) cannot be kept on {dp_size} "
                f"data-parallel ranks: a data-parallel size in {sizes} keeps it, or choose batch_size and "
                f"accumulate_grad_batches so that {dp_size} divides the global batch in whole micro-batches")
        self._check_tail(dp_size)
        return G // (dp_size * m)

    def _check_tail(self, dp_size: int) -> None:
        """The epoch's last, short step must split into the same whole micro-batches as without switches."""
        tail = self.epoch_length() % self.global_batch_size
        if not tail or dp_size == self.reference_dp:
            return
        m = self.micro_batch_size
        if tail % (dp_size * m) or (tail // self.reference_dp) % m:
            raise ValueError(
                f"every epoch ends with a short step of {tail} samples ({self.epoch_length()} a epoch, global batch "
                f"{self.global_batch_size}) that {dp_size} data-parallel ranks cannot read in the same whole "
                f"micro-batches of {m} as {self.reference_dp} ranks do, so the gradient of that step would change: "
                "make the epoch a multiple of the global batch (the dataset's length, drop_last, "
                "limit_train_batches) or keep the data-parallel size")

    def set_layout(self, dp_size: int, dp_rank: int, step: int | None = None, micro_done: int = 0) -> None:
        """Read as rank ``dp_rank`` of ``dp_size`` from the epoch's step ``step`` (default: where the iterator
        is), after this rank has read ``micro_done`` micro-batches of the epoch."""
        check_rank(dp_size, dp_rank)
        if self.training:
            self.accumulation_for(dp_size)
            if step is not None:
                self.seek(step)
            self._base = (self._next_step, micro_done)
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self._sync_base_fields()

    def seek(self, step: int) -> None:
        """Continue at the epoch's step ``step``: resume, or re-sync after a switch."""
        if not 0 <= step <= self.steps_per_epoch:
            raise ValueError(f"step {step} is outside the epoch's {self.steps_per_epoch} steps")
        self._next_step = step
        self._version += 1

    @property
    def next_step(self) -> int:
        return self._next_step

    def __len__(self) -> int:
        """Indices this rank reads in the epoch as it runs: what it read before the current split, then the rest.

        Lightning compares its micro-batch count since the epoch's start with this length to end the epoch."""
        if not self.training:
            return self.epoch_length() // self.dp_size
        step, micro_done = self._base
        # Every step from there splits evenly over the ranks (`accumulation_for` holds each split to it).
        rest = (self.epoch_length() - self.step_window(step)[0]) // self.dp_size
        return micro_done * self.micro_batch_size + rest

    def __iter__(self) -> Iterator[int]:
        if not self.training:
            return iter(self.order()[self.dp_rank::self.dp_size])
        return self._generate()

    def _generate(self) -> Iterator[int]:
        # From the position to the epoch's end: nothing when the epoch is over (a resume at its last step), until
        # `set_epoch` starts the next one.
        while self._next_step < self.steps_per_epoch:
            version, step = self._version, self._next_step
            mine = self.rank_indices(step)
            self._next_step = step + 1  # before the step's last index: a consumer stopping there sees the next
            for index in mine:
                if self._version != version:
                    break  # the position jumped mid-step: drop the rest, continue where it now points
                if self.trace is not None:
                    self.trace.append(index)
                yield index

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "next_step": self._next_step, "reference_dp": self.reference_dp,
                "global_batch_size": self.global_batch_size, "epoch_length": self.epoch_length(),
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The reference split and position of a run saved at another data-parallel size."""
        for key in ("global_batch_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"the checkpoint's data was read with {key}={state[key]!r}, this run has "
                                 f"{getattr(self, key)!r}: resume with the same {key}")
        self.reference_dp = int(state["reference_dp"])
        self._order = None
        if self.epoch_length() != state.get("epoch_length", self.epoch_length()):
            raise ValueError(f"the checkpoint's epochs had {state['epoch_length']} samples, this run's have "
                             f"{self.epoch_length()}: resume with the same dataset")
        self._epoch = int(state["epoch"])
        self.seek(int(state["next_step"]))
        self._sync_base_fields()


class _Indexed:
    """What `DistributedSampler.__init__` needs of a dataset: its length (a sampler's, for a wrapped sampler)."""

    def __init__(self, source: Sized | Sampler) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)
