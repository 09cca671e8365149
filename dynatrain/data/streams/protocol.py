"""What every stream adapter offers the strategy, and the position it re-splits at."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from torch.utils.data import DataLoader


class Position(NamedTuple):
    """Where the next step of training reads, identical on every rank: the epoch the loop is in, the global samples
    the epoch's steps took so far, the global samples taken since training began, and the global batch (samples an
    optimizer step takes, kept through every switch)."""

    epoch: int
    in_epoch: int
    total: int
    global_batch: int


class StreamAdapter(Protocol):
    loader: DataLoader  # the loader to train on: the user's, or one re-made around the adapter's dataset
    micro_batch_size: int
    owns_position: bool  # False: the library keeps its own position (and resumes from its own state)

    def set_data_parallel(self, dp_size: int, dp_rank: int, position: Position) -> None: ...

    def epoch_samples(self, epoch: int) -> int | None:
        """Global samples the loop's ``epoch`` holds; None for an endless stream (the loop's epoch never ends)."""

    def check(self, dp_size: int, global_batch: int) -> None:
        """Raise ValueError, with what to change, when ``dp_size`` ranks cannot read the order exactly."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


Remake = Callable[[DataLoader, object], DataLoader]  # the strategy's re-instantiation of a loader around a dataset
