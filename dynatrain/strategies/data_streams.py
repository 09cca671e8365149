"""The training loaders over an `IterableDataset` that `DataSplit` re-splits through an adapter of
`dynatrain.data.streams` (the `DataParallelIterable` protocol, LitData, Hugging Face streaming datasets).

Every position handed to an adapter derives from the optimizer steps taken, identical on every rank: the global
batch G (kept through every switch), the loop's epoch and the steps since it began. A loader whose dataset no adapter
takes is left as it is, with the reason every switch that changes its split is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from torch.utils.data import DataLoader

from dynatrain.data.streams import Position, StreamAdapter, adapt

if TYPE_CHECKING:
    import lightning.pytorch as pl


@dataclass
class Stream:
    adapter: StreamAdapter
    global_batch_size: int
    position: tuple | None = None  # the last (dp_size, dp_rank, Position) it was given

    @property
    def loader(self) -> DataLoader:
        return self.adapter.loader

    @property
    def micro_batch_size(self) -> int:
        return self.adapter.micro_batch_size


def take(dataloader: DataLoader, dp_size: int, dp_rank: int, global_batch: int, saved: dict | None,
         mode) -> Stream | str:
    """The stream of a training loader, its adapter restored from ``saved``; or why it cannot be re-split."""
    adapter = adapt(dataloader, dp_size, dp_rank, lambda loader, dataset: remake(loader, dataset, mode))
    if isinstance(adapter, str):
        return adapter
    if saved is not None and saved.get("adapter"):
        adapter.load_state_dict(saved["adapter"])
    if adapter.owns_position:
        ignore_loader_state(adapter.loader)
    return Stream(adapter, int(saved["global_batch_size"]) if saved else global_batch)


def remake(dataloader: DataLoader, dataset, mode) -> DataLoader:
    """``dataloader`` re-made around ``dataset`` with Lightning's re-instantiation helper (also for a subclass such
    as torchdata's `StatefulDataLoader`), every other argument as the user gave it."""
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, None, mode)
    args, kwargs = list(args), dict(kwargs)
    names = list(getattr(dataloader, "__pl_saved_arg_names", ()))
    if "dataset" in kwargs or "dataset" not in names:
        kwargs["dataset"] = dataset
    else:
        args[names.index("dataset")] = dataset
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def ignore_loader_state(loader: DataLoader) -> None:
    """Lightning restores a stateful loader (LitData's, torchdata's) from the state the saving rank's split had;
    the strategy positions an owned loader itself, from the steps, for the split it reads now."""
    if callable(getattr(loader, "load_state_dict", None)) and callable(getattr(loader, "state_dict", None)):
        loader.load_state_dict = lambda state_dict: None


def position(trainer: "pl.Trainer", stream: Stream, first_step: int) -> Position:
    G = stream.global_batch_size
    return Position(trainer.current_epoch, (trainer.global_step - first_step) * G, trainer.global_step * G, G)


def resplit(stream: Stream, dp_size: int, dp_rank: int, at: Position) -> None:
    """The stream read as rank ``dp_rank`` of ``dp_size`` from ``at``; nothing when it reads there already."""
    key = (dp_size, dp_rank, at)
    if stream.position != key:
        stream.adapter.set_data_parallel(dp_size, dp_rank, at)
        stream.position = key


def accumulation(stream: Stream, dp_size: int) -> int:
    if stream.global_batch_size % (dp_size * stream.micro_batch_size):
        raise ValueError(f"the global batch of {stream.global_batch_size} samples cannot be kept on {dp_size} "
                         f"data-parallel ranks with batch_size={stream.micro_batch_size}")
    return stream.global_batch_size // (dp_size * stream.micro_batch_size)


def length(stream: Stream, dp_size: int, at: Position, micro_done: int) -> float:
    """Micro-batches this rank reads in the running epoch: ``micro_done`` read, then its share of the rest."""
    samples = stream.adapter.epoch_samples(at.epoch)
    if samples is None:
        return float("inf")
    return micro_done + (samples - at.in_epoch) // (dp_size * stream.micro_batch_size)


def state(stream: Stream) -> dict:
    return {"global_batch_size": stream.global_batch_size, "adapter": stream.adapter.state_dict()}
