"""Samplers keyed by global sample index, so the data a step sees does not depend on the layout.

Global batch k of an epoch is `perm[k*G : (k+1)*G]` for a permutation seeded by (seed, epoch). Its
position i goes to data-parallel rank d at accumulation micro-step a, slot j, where
`i = a*(D*m) + d*m + j`: flattening what every rank sees by (a, d, j) gives the global batch back in
order for any D and micro-batch size m. A layout switch therefore changes who reads which sample, never
which samples form a step.

Where a switch may happen: only between optimizer steps. `set_layout`/`set_micro_batch_size` apply
from the next global step a running iterator starts; a step already begun finishes under the layout it
began with. With `num_workers=0` nothing is read ahead (Lightning 2.6 does not prefetch from a loader
that has a length), so the running iterator simply carries on under the new layout. DataLoader
workers read `prefetch_factor * num_workers` micro-batches ahead, part of them under the old layout:
then `seek(consumed_samples)` and restart the data iterator, which discards what was read ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DistributedSampler


def check_batch_sizes(global_batch_size: int, dp_size: int, micro_batch_size: int) -> int:
    """The number of accumulation micro-steps, or a ValueError naming global batch sizes that work."""
    for name, value in (("global_batch_size", global_batch_size), ("dp_size", dp_size),
                        ("micro_batch_size", micro_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    per_step = dp_size * micro_batch_size
    if global_batch_size % per_step:
        lower = global_batch_size // per_step * per_step
        options = [g for g in (lower, lower + per_step) if g > 0]
        micro = [d for d in range(1, micro_batch_size + 1) if global_batch_size % (dp_size * d) == 0]
        hint = f"; or keep it and use micro_batch_size in {micro}" if micro else ""
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of dp_size*micro_batch_size = "
            f"{dp_size}*{micro_batch_size} = {per_step}: use a multiple of {per_step} such as "
            f"{' or '.join(map(str, options))}{hint}"
        )
    return global_batch_size // per_step


def check_rank(dp_size: int, dp_rank: int) -> None:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size - 1}] for dp_size={dp_size}, got {dp_rank}")


class GlobalBatchSampler(DistributedSampler):
    """Yields this data-parallel rank's sample indices, step after step, for `DataLoader(batch_size=m)`.

    A subclass of `DistributedSampler` so that Lightning leaves it in place instead of wrapping it.
    An epoch is `len(dataset) // G` full global batches; the remainder is dropped.

    The position is `consumed_samples`, counted across epochs. Without a step counter the iterator
    advances it when it hands out a step's last index. With `attach_step_counter` (the data module
    attaches `trainer.global_step`) it counts optimizer steps instead, which stays right when the loader
    has fetched ahead of training.
    """

    def __init__(
        self,
        dataset: Sized | int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        n = dataset if isinstance(dataset, int) else len(dataset)
        self._accumulation = check_batch_sizes(global_batch_size, dp_size, micro_batch_size)
        check_rank(dp_size, dp_rank)
        if n < global_batch_size:
            raise ValueError(f"the training set has {n} samples, fewer than one global batch of {global_batch_size}: "
                             "lower global_batch_size or seq_len, or add data")
        self.num_train_samples = n
        self.global_batch_size = global_batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.micro_batch_size = micro_batch_size
        self._consumed = 0
        self._version = 0  # bumped by every jump of the position, so a running iterator notices it
        self._counter: Callable[[], int] | None = None
        self._anchor = (0, 0)
        self._perm_cache: tuple[int, torch.Tensor] | None = None
        self.trace: list[int] | None = None  # when a list: every index handed out is appended (a check's record)
        super().__init__(range(n) if isinstance(dataset, int) else dataset, num_replicas=dp_size, rank=dp_rank,
                         shuffle=shuffle, seed=seed, drop_last=True)
        self._sync_base_fields()


    def _sync_base_fields(self) -> None:
        # DistributedSampler's public fields, kept truthful for code that reads them.
        self.num_replicas = self.dp_size
        self.rank = self.dp_rank
        self.num_samples = len(self)
        self.total_size = self.num_samples * self.dp_size

    # -- layout ---------------------------------------------------------------------------------

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per optimizer step: G / (D*m)."""
        return self._accumulation

    def set_layout(self, dp_size: int, dp_rank: int) -> None:
        """Applies from the next global step an iterator starts (see the module notes on switching)."""
        acc = check_batch_sizes(self.global_batch_size, dp_size, self.micro_batch_size)
        check_rank(dp_size, dp_rank)
        self.dp_size, self.dp_rank, self._accumulation = dp_size, dp_rank, acc
        self._sync_base_fields()

    def set_micro_batch_size(self, micro_batch_size: int) -> None:
        """Applies from the next global step an iterator starts; the DataLoader's batch_size must match."""
        self._accumulation = check_batch_sizes(self.global_batch_size, self.dp_size, micro_batch_size)
        self.micro_batch_size = micro_batch_size
        self._sync_base_fields()

    # -- position -------------------------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        return self.num_train_samples // self.global_batch_size

    @property
    def samples_per_epoch(self) -> int:
        return self.steps_per_epoch * self.global_batch_size

    @property
    def consumed_samples(self) -> int:
        """Global sample index (across epochs) of the first sample of the next optimizer step."""
        if self._counter is None:
            return self._consumed
        consumed, step = self._anchor
        done = int(self._counter()) - step
        if done < 0:
            raise RuntimeError(f"the step counter went back from {step} to {step + done}; re-attach it after "
                               "restoring a checkpoint")
        return consumed + done * self.global_batch_size

    @property
    def global_step(self) -> int:
        """Optimizer steps taken since the first sample (all epochs)."""
        return self.consumed_samples // self.global_batch_size

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.samples_per_epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        # DistributedSampler.__init__ assigns it; the position stays the only source of the epoch.
        pass

    def seek(self, consumed_samples: int) -> None:
        """Continue at global sample `consumed_samples` (a multiple of G): resume, skip, or re-sync."""
        if consumed_samples < 0 or consumed_samples % self.global_batch_size:
            raise ValueError(f"consumed_samples must be a non-negative multiple of global_batch_size="
                             f"{self.global_batch_size}, got {consumed_samples}")
        self._consumed = consumed_samples
        self._version += 1
        if self._counter is not None:
            self._anchor = (consumed_samples, int(self._counter()))

    def attach_step_counter(self, counter: Callable[[], int] | None) -> None:
        """Count progress by `counter()` (optimizer steps taken) from now on; None detaches it."""
        current = self.consumed_samples
        self._counter = counter
        self.seek(current)

    def set_epoch(self, epoch: int) -> None:
        """Accepted for Lightning, which calls it before every epoch; it does not move the position.

        The position alone says which epoch's order is read, and it moves into the next epoch by itself.
        Lightning's epoch counter can run ahead of it (a run stopped by `max_steps` counts its epoch as
        finished; `limit_train_batches` cuts epochs short): following it would skip samples.
        """

    def remaining_in_epoch(self) -> int:
        """Indices this rank still yields in the current epoch, under the current layout."""
        step_in_epoch = (self.consumed_samples // self.global_batch_size) % self.steps_per_epoch
        return (self.steps_per_epoch - step_in_epoch) * self.global_batch_size // self.dp_size

    def __len__(self) -> int:
        """Indices this rank yields in a whole epoch under the current layout.

        A whole epoch, not what is left of it: after a mid-epoch resume Lightning counts batches from its
        restored in-epoch progress, so it needs the full length to end the epoch at the right batch.
        """
        return self.samples_per_epoch // self.dp_size

    # -- order ----------------------------------------------------------------------------------

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of the training set in `epoch`; identical on every rank."""
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_train_samples, generator=g)
        else:
            perm = torch.arange(self.num_train_samples)
        self._perm_cache = (epoch, perm)
        return perm

    def global_batch(self, step: int) -> list[int]:
        """The G sample indices of global step `step` (counted across epochs), in batch order."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        G = self.global_batch_size
        return self.permutation(epoch)[in_epoch * G : (in_epoch + 1) * G].tolist()

    def rank_indices(self, step: int, dp_size: int | None = None, dp_rank: int | None = None,
                     micro_batch_size: int | None = None) -> list[int]:
        """What rank `dp_rank` of `dp_size` reads at `step`, micro-step after micro-step."""
        D = self.dp_size if dp_size is None else dp_size
        r = self.dp_rank if dp_rank is None else dp_rank
        m = self.micro_batch_size if micro_batch_size is None else micro_batch_size
        A = check_batch_sizes(self.global_batch_size, D, m)
        batch = torch.tensor(self.global_batch(step)).view(A, D, m)
        return batch[:, r, :].reshape(-1).tolist()

    def __iter__(self) -> Iterator[int]:
        return self._generate()

    def _generate(self) -> Iterator[int]:
        first_epoch: int | None = None
        while True:
            # Read lazily at every step: a seek or layout change made between steps applies here.
            version = self._version
            start = self._consumed
            epoch, step_in_epoch = divmod(start // self.global_batch_size, self.steps_per_epoch)
            if first_epoch is None:
                first_epoch = epoch
            elif epoch != first_epoch:
                return  # one pass of `iter()` is one epoch, as for any sampler
            mine = self.rank_indices(start // self.global_batch_size)
            last = len(mine) - 1
            for n, index in enumerate(mine):
                if self._version != version:
                    break  # the position jumped mid-step: drop the rest, continue where it now points
                if n == last:
                    # Advanced before the last index is handed out, so a consumer that stops right after
                    # this step's last micro-batch sees the position of the next step.
                    self._consumed = start + self.global_batch_size
                if self.trace is not None:
                    self.trace.append(index)
                yield index

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed_samples,
            "global_batch_size": self.global_batch_size,
            "num_train_samples": self.num_train_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position; the layout (D, m) may differ from the one that saved it."""
        for key in ("global_batch_size", "num_train_samples", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's data was sampled with {key}={state[key]!r} but this run has "
                    f"{getattr(self, key)!r}: resume with the same {key} (and the same data and seq_len), or "
                    "start a new run, since the saved position means other samples under a different setting"
                )
        self.seek(int(state["consumed_samples"]))


class ShardedEvalSampler(DistributedSampler):
    """Deterministic validation shards: rank r of D reads windows r, r+D, r+2D, ... of the first `num_used`.

    Every rank gets the same number of samples, because under FSDP each forward pass is a collective
    and a rank with an extra batch would wait forever. `num_used` is cut to a multiple of the global
    batch size when there is enough data, since every valid D divides it: then the validation set is
    the same whatever the layout, and losses before and after a switch compare exactly.
    """

    def __init__(self, dataset: Sized | int, dp_size: int = 1, dp_rank: int = 0, multiple_of: int = 1) -> None:
        n = dataset if isinstance(dataset, int) else len(dataset)
        check_rank(dp_size, dp_rank)
        self.num_total = n
        self.multiple_of = multiple_of
        self.dp_size, self.dp_rank = dp_size, dp_rank
        super().__init__(range(n) if isinstance(dataset, int) else dataset, num_replicas=dp_size, rank=dp_rank,
                         shuffle=False, drop_last=True)
        self._sync_base_fields()

    @property
    def num_used(self) -> int:
        unit = self.multiple_of if self.num_total >= self.multiple_of else self.dp_size
        return self.num_total // unit * unit // self.dp_size * self.dp_size

    def _sync_base_fields(self) -> None:
        self.num_replicas, self.rank = self.dp_size, self.dp_rank
        self.num_samples = len(self)
        self.total_size = self.num_samples * self.dp_size

    def set_layout(self, dp_size: int, dp_rank: int) -> None:
        """Applies from the next `iter()`, which is the next validation run."""
        check_rank(dp_size, dp_rank)
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self._sync_base_fields()

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.dp_rank, self.num_used, self.dp_size))

    def __len__(self) -> int:
        return self.num_used // self.dp_size
