"""`DataSplit`: the strategy's data-parallel split of every training and validation dataloader.

Lightning injects a `DistributedSampler` into a map-style `DataLoader` once, at set-up, for the data-parallel size
of that moment. The strategy takes the loader over as `Strategy.process_dataloader` sees it: the injected sampler
(or Lightning's `DistributedSamplerWrapper` around a user's sampler, or a plain `DistributedSampler` the user made)
becomes an `ElasticSampler` with the same order, and the loader is re-made with Lightning's own re-instantiation
helper. The global batch is the data-parallel size x the loader's batch size x `accumulate_grad_batches` at set-up;
every switch keeps it through accumulation, re-splits every loader for the new data-parallel rank (the same for
every rank of a tp, pp or cp group: cp ranks read whole samples, and the model splits their sequences), and moves Lightning's epoch length with it. A loader over an `IterableDataset` is re-split through an adapter of
`dynatrain.data.streams` (its own `set_data_parallel`, LitData, Hugging Face streaming; `data_streams`). A loader
whose split cannot be re-derived makes every switch that changes the data-parallel size or rank fail at request time.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from dynatrain.runtime import control_group
from dynatrain.data.elastic_sampler import ElasticSampler
import dynatrain.strategies.data_streams as data_streams
from dynatrain.data.streams.torchdata import plain_shuffle
from dynatrain.strategies.fit_loop import (
    micro_batches_done,
    restart_fetcher,
    set_epoch_length,
    set_val_lengths,
    stage_loaders,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy as DynaTrainStrategy  # with dp_size, dp_rank


class BatchMismatchError(RuntimeError):
    """Ranks that must read the same batch (one data-parallel rank: a tp, pp or cp group) read different ones."""


class DataSplit:
    def __init__(self, strategy: "DynaTrainStrategy") -> None:
        self.strategy = strategy
        self.train: list[tuple[DataLoader, ElasticSampler]] = []
        self.val: list[tuple[DataLoader, ElasticSampler]] = []
        self.streams: list[data_streams.Stream] = []
        self.fixed: list[tuple[DataLoader, str]] = []  # the training loaders whose split cannot change, and why
        self.first_step = 0  # the trainer's global step at the start of the current epoch
        self._state: dict | None = None  # restored from a checkpoint (or a joiner's payload), until used
        self._resumed_epoch: int | None = None
        self.check_next_batch = False

    # ---- set-up: Lightning hands every loader to Strategy.process_dataloader ------------------------------
    def process(self, dataloader: object) -> object:
        trainer = self.strategy.lightning_module.trainer if self.strategy.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or not isinstance(dataloader, DataLoader):
            return dataloader
        training = trainer.state.stage == RunningStage.TRAINING
        self._forget_reloaded(trainer, training)
        if isinstance(dataloader.dataset, IterableDataset):
            return self._take_stream(trainer, dataloader) if training else dataloader
        sampler = _index_sampler(dataloader)
        if isinstance(sampler, ElasticSampler):
            (self.train if training else self.val).append((dataloader, sampler))
            return dataloader
        if hasattr(sampler, "set_layout") and hasattr(getattr(trainer, "datamodule", None), "set_layout"):
            return dataloader  # the data module re-splits its own loaders (`LlamaDataModule.set_layout`)
        source, shuffle = _source(sampler), getattr(sampler, "shuffle", False)
        if source is not None and plain_shuffle(source, dataloader.dataset):
            source, shuffle = dataloader.dataset, True
        if source is None:
            if training:
                self.fixed.append((dataloader, f"the training dataloader's sampler {type(sampler).__name__} is not "
                                               "a DistributedSampler that dynatrain can re-split"))
            return dataloader
        micro = dataloader.batch_size if dataloader.batch_size is not None else \
            getattr(dataloader.batch_sampler, "batch_size", None)
        if micro is None:
            if training:
                self.fixed.append((dataloader, f"the training dataloader's batch sampler "
                                               f"{type(dataloader.batch_sampler).__name__} has no batch_size"))
            return dataloader
        size, rank = self.strategy.dp_size, self.strategy.dp_rank
        saved = self._saved_sampler(len(self.train)) if training else None
        reference = int(saved["reference_dp"]) if saved else size  # the split the run started with
        glob = (saved["global_batch_size"] if saved else size * micro * trainer.accumulate_grad_batches) \
            if training else None
        limit = trainer.limit_train_batches
        max_samples = None
        if training and limit != 1.0:  # Lightning's limit, in micro-batches of the first split, kept in samples
            per_rank = -(-len(sampler) // micro)
            max_samples = (int(limit) if isinstance(limit, int) else int(per_rank * limit)) * micro * reference
        elastic = ElasticSampler(source, micro, glob, reference, rank % reference, shuffle=shuffle,
                                 seed=sampler.seed, drop_last=sampler.drop_last, max_samples=max_samples)
        if saved is not None:
            elastic.load_state_dict(saved)
        # Lightning measures the loader right after this, against the count of micro-batches it restored: a resume
        # (or a joiner) inside an epoch, at its end included, sees the epoch as the run read it.
        step, micro_done = self._resumed_position(trainer) if saved is not None else (None, 0)
        elastic.set_layout(size, rank, step=step, micro_done=micro_done)
        try:
            loader = _update_dataloader(dataloader, elastic, mode=trainer.state.stage)
        except (MisconfigurationException, TypeError, ValueError) as e:
            if training:
                self.fixed.append((dataloader, f"the training dataloader {type(dataloader).__name__} cannot be "
                                               f"re-made with another sampler ({str(e).strip().splitlines()[0]})"))
            return dataloader
        (self.train if training else self.val).append((loader, elastic))
        if training:
            data_streams.ignore_loader_state(loader)  # torchdata's StatefulDataLoader: the sampler holds the position
        return loader

    def _forget_reloaded(self, trainer: "pl.Trainer", training: bool) -> None:
        """Lightning (re)loads a stage's loaders: those of its current combined loader are being replaced."""
        old = stage_loaders(trainer, training)
        stale = lambda loader: any(loader is d for d in old)  # noqa: E731
        if training:
            self.train = [(d, s) for d, s in self.train if not stale(d)]
            self.streams = [x for x in self.streams if not stale(x.loader)]
            self.fixed = [(d, why) for d, why in self.fixed if not stale(d)]
        else:
            self.val = [(d, s) for d, s in self.val if not stale(d)]

    def _take_stream(self, trainer: "pl.Trainer", dataloader: DataLoader) -> DataLoader:
        saved = self._saved_stream(len(self.streams))
        size, rank = self.strategy.dp_size, self.strategy.dp_rank
        glob = size * (dataloader.batch_size or 1) * trainer.accumulate_grad_batches
        stream = data_streams.take(dataloader, size, rank, glob, saved, trainer.state.stage)
        if isinstance(stream, str):
            self.fixed.append((dataloader, stream))
            return dataloader
        self.streams.append(stream)
        first = int(self._state["first_step"]) if saved and self._state.get("epoch") == trainer.current_epoch \
            else trainer.global_step
        data_streams.resplit(stream, size, rank, data_streams.position(trainer, stream, first))
        return stream.loader

    # ---- requests -----------------------------------------------------------------------------------------
    @property
    def owned(self) -> bool:
        return bool(self.train or self.streams)

    def accumulation_for(self, dp_size: int) -> int | None:
        """Micro-batches per rank per step on ``dp_size`` ranks that keep the global batch (None: not owned)."""
        found = {s.accumulation_for(dp_size) for _, s in self.train}
        found |= {data_streams.accumulation(stream, dp_size) for stream in self.streams}
        if len(found) > 1:
            raise ValueError(f"the training dataloaders would need different gradient accumulations {sorted(found)} "
                             f"on {dp_size} data-parallel ranks")
        return found.pop() if found else None

    def check(self, dp_size: int, dp_ranks_kept: bool) -> None:
        """Raise ValueError now if a switch to ``dp_size`` ranks could not keep every global batch."""
        if self.fixed and (dp_size != self.strategy.dp_size or not dp_ranks_kept):
            raise ValueError(f"this switch changes the data-parallel split ({self.strategy.dp_size} -> {dp_size} "
                             f"ranks), and {'; '.join(why for _, why in self.fixed)}")
        self.accumulation_for(dp_size)
        if dp_size != self.strategy.dp_size or not dp_ranks_kept:
            for stream in self.streams:
                stream.adapter.check(dp_size, stream.global_batch_size)

    # ---- a switch -----------------------------------------------------------------------------------------
    def apply(self, trainer: "pl.Trainer", dp_size: int, dp_rank: int) -> None:
        """Every loader on the new split from the next optimizer step on; Lightning's epoch length follows."""
        module = self._zoo_module(trainer)
        if module is not None:  # the zoo's data module keeps its own loaders' split
            trainer.accumulate_grad_batches = module.set_layout(dp_size, dp_rank)
        accumulation = self.accumulation_for(dp_size)
        if accumulation is not None:
            trainer.accumulate_grad_batches = accumulation
        micro_done = micro_batches_done(trainer)
        self._resplit(trainer, dp_size, dp_rank, trainer.global_step - self.first_step, micro_done)
        for _, sampler in self.val:
            sampler.set_layout(dp_size, dp_rank)
        self._lengths(trainer, micro_done)
        self._restart_workers(trainer)
        self.check_next_batch = True

    def _resplit(self, trainer: "pl.Trainer", dp_size: int, dp_rank: int, step: int, micro_done: int) -> None:
        """The training loaders read as rank ``dp_rank`` of ``dp_size`` from the epoch's step ``step``, after this
        rank read ``micro_done`` micro-batches of the epoch; a stream from the global sample the steps taken reach."""
        for _, sampler in self.train:
            sampler.set_layout(dp_size, dp_rank, step=min(step, sampler.steps_per_epoch), micro_done=micro_done)
        for stream in self.streams:
            data_streams.resplit(stream, dp_size, dp_rank, data_streams.position(trainer, stream, self.first_step))

    @staticmethod
    def _zoo_module(trainer: "pl.Trainer"):
        datamodule = getattr(trainer, "datamodule", None)
        return datamodule if datamodule is not None and hasattr(datamodule, "set_layout") else None

    def _lengths(self, trainer: "pl.Trainer", micro_done: int = 0, stream_done: int | None = None) -> None:
        """Lightning measures its loaders once; a new split changes how many micro-batches each rank reads."""
        loaders = stage_loaders(trainer, training=True)
        owned = self._owned_lengths(trainer, loaders, micro_done if stream_done is None else stream_done)
        if owned is None and loaders and self.train:  # beside a loader the split does not own
            owned = [len(d) for d, _ in self.train]
        if owned is not None:
            set_epoch_length(trainer, owned)
        elif loaders and trainer.limit_train_batches == 1.0:
            sampler = getattr(self._zoo_module(trainer), "train_sampler", None)
            if sampler is not None and hasattr(sampler, "remaining_in_epoch") and len(loaders) == 1:
                # The zoo's sampler counts its epoch in global samples: what is left of it from here, in this
                # split's micro-batches (Lightning then ends its epoch where the sampler's ends).
                micro = trainer.datamodule.micro_batch_size
                set_epoch_length(trainer, [micro_done + sampler.remaining_in_epoch() // micro])
        if self.val:
            limit = trainer.limit_val_batches
            set_val_lengths(trainer, [min(len(d), limit) if isinstance(limit, int)
                                                     else int(len(d) * limit) for d, _ in self.val])

    def _owned_lengths(self, trainer: "pl.Trainer", loaders: list, micro_done: int) -> list[float] | None:
        """The epoch's micro-batches of every training loader, when the split owns them all and one is finite."""
        lengths = []
        for loader in loaders:
            sampled = [len(d) for d, _ in self.train if d is loader]
            streams = [s for s in self.streams if s.loader is loader]
            if not sampled and not streams:
                return None
            lengths += sampled or [data_streams.length(
                streams[0], self.strategy.dp_size, data_streams.position(trainer, streams[0], self.first_step),
                micro_done)]
        return lengths if any(n != float("inf") for n in lengths) else None

    def _restart_workers(self, trainer: "pl.Trainer") -> None:
        """DataLoader workers read ahead under the old split: start the iterator again, discarding that."""
        if not any(d.num_workers > 0 for d, _ in self.train) and not self.streams:
            return
        if trainer.training:
            restart_fetcher(trainer)

    # ---- Lightning's epochs, checkpoints and steps --------------------------------------------------------
    def on_train_start(self, trainer: "pl.Trainer") -> bool:
        """At the start of fit: whether Lightning restored a checkpoint (or a joiner's payload); every loader then
        continues where the run was, inside the epoch it was saved in or at the start of the next."""
        saved, self._state = self._state, None
        if saved is None:
            return False
        if saved.get("epoch") != trainer.current_epoch:
            # Saved at an epoch's last step: Lightning goes on with the next epoch without announcing it, counting
            # its micro-batches on from the saved epoch's count; the whole next epoch comes after them.
            self.first_step = trainer.global_step
            for _, sampler in self.train:
                sampler.set_epoch(trainer.current_epoch)
        else:
            self.first_step = int(saved["first_step"])
        self._resumed_epoch = trainer.current_epoch
        if self.owned:
            self._keep_global_batch(trainer)
            ready = micro_batches_done(trainer)
            self._resplit(trainer, self.strategy.dp_size, self.strategy.dp_rank,
                          trainer.global_step - self.first_step, ready)
            self._restart_workers(trainer)
            self._lengths(trainer, stream_done=ready)
        return True

    def on_epoch_start(self, trainer: "pl.Trainer") -> bool:
        """Whether the epoch starting is the one training resumed in (already set up by `on_train_start`)."""
        if self._resumed_epoch == trainer.current_epoch:
            self._resumed_epoch = None
            return micro_batches_done(trainer) > 0
        self._resumed_epoch = None
        self.first_step = trainer.global_step
        if self.owned:
            self._keep_global_batch(trainer)
        for stream in self.streams:  # a finite stream's next epoch; an endless one goes on from the steps taken
            data_streams.resplit(stream, self.strategy.dp_size, self.strategy.dp_rank,
                                 data_streams.position(trainer, stream, self.first_step))
        self._lengths(trainer)
        return False

    def _resumed_position(self, trainer: "pl.Trainer") -> tuple[int | None, int]:
        """(step of the epoch, micro-batches this rank read in it) that a restored run goes on from."""
        if self._state is None or self._state.get("epoch") != trainer.current_epoch:
            return None, 0
        step = trainer.global_step - int(self._state["first_step"])
        return step, micro_batches_done(trainer)

    def _keep_global_batch(self, trainer: "pl.Trainer") -> None:
        accumulation = self.accumulation_for(self.strategy.dp_size)  # a resume may run on another split
        if accumulation is not None:
            trainer.accumulate_grad_batches = accumulation

    def state_dict(self, trainer: "pl.Trainer | None") -> dict:
        state: dict[str, Any] = {"first_step": self.first_step,
                                 "epoch": trainer.current_epoch if trainer is not None else 0}
        if self.train:
            state["samplers"] = [s.state_dict() for _, s in self.train]
        if self.streams:
            state["streams"] = [data_streams.state(s) for s in self.streams]
        return state

    def load_state_dict(self, state: dict) -> None:
        self._state = dict(state)
        self.first_step = int(state.get("first_step", 0))  # a joiner re-splits before its first epoch starts

    def _saved_sampler(self, i: int) -> dict | None:
        samplers = (self._state or {}).get("samplers") or []
        return samplers[i] if i < len(samplers) else None

    def _saved_stream(self, i: int) -> dict | None:
        streams = (self._state or {}).get("streams") or []
        return streams[i] if i < len(streams) else None

    def check_batch(self, trainer: "pl.Trainer", batch: Any) -> None:
        """The ranks of each data-parallel rank compare a fingerprint of their batch; raise naming them if any
        differ. After a switch (its first micro-batch), and at every micro-batch with ``data.check_batches``."""
        strategy = self.strategy
        if not (self.check_next_batch or strategy.data_options.check_batches) or strategy.world_size == 1:
            return
        self.check_next_batch = False
        if strategy.detached or strategy.local_only:
            return
        rows = control_group.all_gather_ints([strategy.dp_rank, fingerprint(batch)], strategy.control_group)
        groups: dict[int, dict[int, list[int]]] = {}
        for rank, (dp_rank, fp) in enumerate(rows):
            groups.setdefault(dp_rank, {}).setdefault(fp, []).append(rank)
        bad = {d: fps for d, fps in groups.items() if len(fps) > 1}
        if bad:
            d, fps = sorted(bad.items())[0]
            split = " against ".join(f"ranks {ranks}" for ranks in fps.values())
            raise BatchMismatchError(
                f"step {trainer.global_step}: ranks {sorted(r for rs in fps.values() for r in rs)} share data-parallel "
                f"rank {d} (layout {strategy.parallel_config.short()}) and must read the same batch, but {split} read "
                "different ones: their tensor- or pipeline-parallel computation would mix unrelated samples. Let the "
                "strategy split the data (Lightning's sampler injection, use_distributed_sampler=True), or split it "
                "by trainer.strategy.dp_rank / dp_size")


def fingerprint(batch: Any) -> int:
    """A CRC-32 of every tensor in a (nested) batch (its dtype, shape and bytes) and of its plain values."""
    digest = 0
    stack = [batch]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            t = item.detach().cpu().contiguous()
            digest = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode(), digest)
            digest = zlib.crc32(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"", digest)
        elif isinstance(item, dict):
            stack.extend(item[k] for k in sorted(item, key=str))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, (int, float, str, bytes)):
            digest = zlib.crc32(repr(item).encode(), digest)
    return digest


def _index_sampler(dataloader: DataLoader):
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return getattr(batch_sampler, "sampler", None)
    return dataloader.sampler


def _source(sampler):
    """What a distributed sampler splits, if dynatrain can split it again: the dataset, or a user's sampler."""
    if type(sampler) is DistributedSamplerWrapper:
        return sampler.dataset._sampler
    if type(sampler) is DistributedSampler:
        return sampler.dataset
    return None
