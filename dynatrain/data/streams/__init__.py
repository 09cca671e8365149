"""Streaming data pipelines whose data-parallel split the strategy re-derives at a switch, a resume or for a joiner.

A map-style dataset is re-split by `ElasticSampler`; an `IterableDataset` splits itself, so each streaming library
gets an adapter here that re-splits it from a position the strategy computes from the steps taken (`Position`):

- `DataParallelIterable` (``set_data_parallel``, `dynatrain.data.iterable`): `ProtocolStream`.
- LitData's `StreamingDataset` read by its `StreamingDataLoader`: `LitDataStream` (litdata.py), which reads LitData's
  own canonical stream (its elastic resume's) in every epoch, whatever the world size.
- A Hugging Face `datasets.IterableDataset` (streaming, optionally shuffled with a buffer and split by node) read by a
  `DataLoader` or torchdata's `StatefulDataLoader`: `HFStream` (hf.py), which keeps reading the splits the run
  started with.

Anything else is refused with the reason (`adapt` returns it), and the strategy refuses every switch that changes the
split. Each adapter imports its library only when it meets one of its datasets: none of them is a dependency.
"""

from __future__ import annotations

from torch.utils.data import DataLoader

from dynatrain.data.iterable import DataParallelIterable
from dynatrain.data.streams.protocol import Position, Remake, StreamAdapter

__all__ = ["Position", "Remake", "StreamAdapter", "adapt"]


def adapt(loader: DataLoader, dp_size: int, dp_rank: int, remake: Remake) -> StreamAdapter | str:
    """The adapter of a loader over an `IterableDataset`, or why its split cannot be re-derived."""
    dataset = loader.dataset
    library = type(dataset).__module__.split(".", 1)[0]
    if loader.num_workers > 0 and loader.persistent_workers:
        return (f"{type(dataset).__name__} is read by persistent DataLoader workers, whose copies of the dataset a "
                "switch cannot reach: use persistent_workers=False")
    if isinstance(dataset, DataParallelIterable):
        return ProtocolStream(loader)
    if library == "litdata":
        from dynatrain.data.streams.litdata import adapt_litdata

        return adapt_litdata(loader, dp_size, dp_rank)
    if library == "datasets":
        from dynatrain.data.streams.hf import adapt_hf

        return adapt_hf(loader, dp_size, dp_rank, remake)
    if library == "streaming":
        return ("MosaicML Streaming's StreamingDataset reads its world (ranks, nodes, workers) when its iterator "
                "starts and partitions its samples through shared memory for that world; it has no call that "
                "re-partitions a running dataset for another data-parallel size and rank, which is what an online "
                "re-split needs (it resumes on another world only from a restart, through num_canonical_nodes). "
                "Keep the data-parallel size, or read the data with LitData's StreamingDataset or a map-style dataset")
    return (f"the training dataloader reads an IterableDataset ({type(dataset).__name__}) whose split dynatrain cannot "
            "re-derive: implement set_data_parallel(dp_size, dp_rank, next_global_sample) on it "
            "(dynatrain.data.iterable.DataParallelIterable), or read LitData's StreamingDataset or a Hugging Face "
            "streaming dataset (docs/architecture.md)")


class ProtocolStream:
    """A dataset that implements `DataParallelIterable`: an endless stream addressed by global sample."""

    owns_position = True

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.micro_batch_size = loader, loader.batch_size or 1

    def set_data_parallel(self, dp_size: int, dp_rank: int, position: Position) -> None:
        self.loader.dataset.set_data_parallel(dp_size, dp_rank, position.total)

    def epoch_samples(self, epoch: int) -> None:
        return None

    def check(self, dp_size: int, global_batch: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
