"""LitData's `StreamingDataset` read by its `StreamingDataLoader`, re-split between two steps.

LitData defines the order of an epoch independently of the world size: its elastic resume (litdata.streaming.elastic)
rebuilds the epoch's *canonical stream* (what the first run's ranks and workers read, batch after batch in lockstep:
batch b of the epoch is the (b // W)-th micro-batch of rank b % W) and hands its remainder out to the new ranks and
workers in the same lockstep. Global step s of an epoch is therefore the window ``[s*G, (s+1)*G)`` of that stream
under any split that keeps the global batch G. This adapter puts the loader in that mode at every epoch, switch,
resume and admission, with the data-parallel size and rank instead of the world's (the ranks of a tp or pp group
read the same batch) and with the first split's grid (data-parallel size, nodes, workers, batch size) as the
canonical one, so an epoch after a switch is also the one the run without switches reads (LitData alone would take
the next epoch's order from the new world).

LitData cuts an epoch to whole batches on every rank of the first grid (``drop_last``, the default on several
ranks): that cut defines the canonical stream, which its restripe would then cut again, to whole rounds of the new
grid's ranks x workers x batch, dropping the epoch's last samples. The adapter keeps the first cut (the state's
``drop_last``, from which LitData builds its shuffler) and lifts the second (the dataset's own, which the restripe
reads), through LitData's ``force_override_state_dict``; the warnings LitData logs for that are filtered out. A
dataset read with ``drop_last=False`` whose samples do not split into whole batches of the first grid has no lockstep
order: it keeps LitData's own split, and every switch that changes it is refused.

LitData's loader state (what Lightning saves and restores for it) is of the saving rank's split; the strategy's own
position replaces it after a restore.
"""

from __future__ import annotations

import copy
import logging

from torch.utils.data import DataLoader

from dynatrain.data.sampler import check_rank
from dynatrain.data.streams.protocol import Position


def adapt_litdata(loader: DataLoader, dp_size: int, dp_rank: int) -> "LitDataStream | str":
    from litdata import StreamingDataLoader, StreamingDataset

    dataset = loader.dataset
    if not isinstance(dataset, StreamingDataset):
        return (f"LitData's {type(dataset).__name__} draws its samples from its datasets in each DataLoader worker "
                "with one seed, an order that depends on the number of ranks and workers, and LitData resumes it only "
                "on the same world size, workers and batch size (its elastic resume covers StreamingDataset alone): "
                "keep the data-parallel size, or train on one StreamingDataset (for a mixture, optimize the mixed "
                "samples into one dataset)")
    if not isinstance(loader, StreamingDataLoader):
        return ("a LitData StreamingDataset read by a plain DataLoader does not report what its workers read: "
                "read it with litdata.StreamingDataLoader")
    if getattr(dataset, "posix_fast", None) is not None and dataset.posix_fast.window_shuffle:
        return ("LitData's POSIX-fast window shuffle resumes whole chunks only, so its elastic order is not exact: "
                "disable it (LITDATA_POSIX_FAST=0) to switch the data-parallel size")
    return LitDataStream(loader, dp_size, dp_rank)


class _QuietOverride(logging.Filter):
    """Drops the warnings of the override the adapter makes on purpose (in every worker, at every iterator)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Using state dict override") or message.startswith("Overriding state drop_last"))


_QUIET = _QuietOverride()


class LitDataStream:
    def __init__(self, loader: DataLoader, dp_size: int, dp_rank: int) -> None:
        from litdata.utilities.env import _DistributedEnv

        self.loader, self.dataset = loader, loader.dataset
        self.micro_batch_size = loader.batch_size or 1
        self.workers = max(loader.num_workers, 1)
        detected = _DistributedEnv.detect()
        self.nodes = max(1, detected.num_nodes)
        # The first split's grid, which defines the canonical stream for the whole run (a resume or a joiner brings
        # the saved one: LitData's default drop_last follows the world size the dataset was made in, 1 for a joiner).
        self._epoch = 0
        self.grid = {"world_size": dp_size, "num_nodes": self.nodes if dp_size % self.nodes == 0 else 1,
                     "num_workers": self.workers, "batch_size": self.micro_batch_size,
                     "drop_last": bool(self.dataset.drop_last)}
        self._items: int | None = None
        self._split(dp_size, dp_rank)
        self._cut(self.grid["drop_last"])

    def _cut(self, drop_last: bool) -> None:
        """The canonical cut: a shuffler of the dataset built for ``drop_last``."""
        self.drop_last = drop_last
        self.dataset.drop_last, self.dataset.shuffler = drop_last, None
        self.dataset.reset_state_dict()
        self.dataset.get_len(self.loader.num_workers, self.micro_batch_size)  # sets up its cache and shuffler
        self.shuffler = self.dataset.shuffler
        self.unfit = self._misfit()

    # ---- the canonical epoch --------------------------------------------------------------------------------
    def _split(self, dp_size: int, dp_rank: int) -> None:
        from litdata.utilities.env import _DistributedEnv

        check_rank(dp_size, dp_rank)
        nodes = self.nodes if dp_size % self.nodes == 0 else 1
        self.dataset.distributed_env = _DistributedEnv(world_size=dp_size, global_rank=dp_rank, num_nodes=nodes)

    def items(self) -> int:
        """Samples the dataset holds (after LitData's subsampling)."""
        if self._items is None:
            self._items = sum(int(i[2]) - int(i[1]) for i in self.shuffler.cache.get_chunk_intervals())
        return self._items

    def _misfit(self) -> str | None:
        unit = self.grid["world_size"] * self.grid["batch_size"]
        if not self.drop_last and self.items() % unit:
            return (f"the LitData stream is read with drop_last=False and its {self.items()} samples do not split into "
                    f"whole batches of {self.grid['batch_size']} on {self.grid['world_size']} ranks, so its ranks read "
                    "unequal shares in no common order: read it with drop_last=True (LitData's default on several "
                    "ranks), or keep the data-parallel size")
        return None

    @property
    def owns_position(self) -> bool:
        return self.unfit is None

    def epoch_samples(self, epoch: int) -> int | None:
        """Samples of the canonical stream of the loop's ``epoch``: what the first grid's ranks read."""
        if self.unfit is not None:
            return None
        from litdata.utilities.env import _DistributedEnv

        grid = _DistributedEnv(self.grid["world_size"], 0, self.grid["num_nodes"])
        _, intervals = self.shuffler.get_chunks_and_intervals_per_workers(
            grid, self.grid["num_workers"], self.grid["batch_size"], epoch + 1)
        return sum(int(i[2]) - int(i[1]) for worker in intervals for i in worker)

    def check(self, dp_size: int, global_batch: int) -> None:
        if self.unfit is not None:
            raise ValueError(self.unfit)
        samples = self.epoch_samples(self._epoch)
        tail, unit = samples % global_batch, dp_size * self.micro_batch_size
        if tail % unit:
            raise ValueError(
                f"every epoch of the LitData stream ends with a short step of {tail} samples ({samples} an epoch, "
                f"global batch {global_batch}) that {dp_size} data-parallel ranks cannot read in whole micro-batches "
                f"of {self.micro_batch_size}: make the epoch a multiple of the global batch, or keep the "
                "data-parallel size")

    # ---- the split ------------------------------------------------------------------------------------------
    def set_data_parallel(self, dp_size: int, dp_rank: int, position: Position) -> None:
        """Rank ``dp_rank`` of ``dp_size`` reads the canonical stream of ``position.epoch`` from its global sample
        ``position.in_epoch`` on, as LitData's elastic resume does, from the loader's next iterator on."""
        self._split(dp_size, dp_rank)
        if self.unfit is not None:
            return  # LitData's own split and resume, as without dynatrain (a live switch is refused by `check`)
        from litdata.streaming.elastic import _round_down_drop_first

        litdata_epoch = position.epoch + 1  # LitData counts epochs from 1
        drop_first = _round_down_drop_first(position.in_epoch, dp_size, self.micro_batch_size)
        if drop_first != position.in_epoch:
            raise ValueError(f"global sample {position.in_epoch} of the epoch is not a whole micro-batch of "
                             f"{dp_size} ranks: keep the global batch a multiple of the data-parallel size")
        self._epoch = position.epoch
        self.dataset.drop_last = False  # the restripe's cut; the state's drop_last keeps the canonical one
        self.dataset._force_override_state_dict = True
        logging.getLogger("litdata.streaming.dataset").addFilter(_QUIET)
        self.dataset.reset_state_dict()
        state = copy.deepcopy(self.dataset.state_dict(0, self.loader.num_workers, self.micro_batch_size))
        state.update(
            num_samples_yielded=0, current_epoch=litdata_epoch, sample_in_epoch=position.in_epoch,
            resume_mode="elastic", num_canonical_nodes=self.grid["world_size"], drop_last=self.drop_last,
            world_size=dp_size, num_workers=self.workers, batch_size=self.micro_batch_size,
            initial_world_size=self.grid["world_size"], initial_num_nodes=self.grid["num_nodes"],
            initial_num_workers=self.grid["num_workers"], initial_batch_size=self.grid["batch_size"])
        type(self.loader).load_state_dict(self.loader, {"dataset": state, "current_epoch": litdata_epoch,
                                                       "num_samples_yielded": 0, "latest_worker_idx": 0})
        self.dataset._elastic_drop_first = drop_first  # the loader rounded it by the world's size, not the split's

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"grid": dict(self.grid), "items": self.items()}

    def load_state_dict(self, state: dict) -> None:
        """The saved run's first grid; the epoch's position comes from the strategy's step count."""
        if state.get("items", self.items()) != self.items():
            raise ValueError(f"the checkpoint's LitData stream held {state['items']} samples, this one holds "
                             f"{self.items()}: resume with the same dataset")
        self.grid = dict(state["grid"])
        self._cut(bool(self.grid.get("drop_last", self.drop_last)))
