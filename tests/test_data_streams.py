"""The adapters of dynatrain.data.streams in one process: ranks simulated by their split, each step read by every
rank of the split it has then (4, 2, 3 ranks, ... across epoch boundaries), against what the library itself gives the
ranks of a run that never switches. The end-to-end runs are tests/test_data_streams_mp.py."""

from __future__ import annotations

import types

import pytest
from _streams import write_jsonl, write_litdata
from torch.utils.data import DataLoader, IterableDataset

from dynatrain.data.streams import Position, adapt

M, W = 2, 4  # micro-batch, the data-parallel size the run starts with
G = W * M * 3  # global batch: accumulation 3 on 4 ranks
SPLITS = [4, 2, 3, 3, 4, 2, 4, 3]  # the split of each step


def _remake(loader, dataset):
    return DataLoader(dataset, batch_size=loader.batch_size)


def _steps_of_plain_ranks(rank_batches: list[list[list[int]]], steps: int) -> list[list[int]]:
    """Global steps of W ranks, each reading its own batches in order, accumulation G // (W*M)."""
    acc = G // (W * M)
    return [sorted(i for rank in rank_batches for b in rank[s * acc:(s + 1) * acc] for i in b) for s in range(steps)]


def _read_switching(adapters: list, steps: int, epoch_samples: int | None, ids) -> list[list[int]]:
    out = []
    for s, size in enumerate(SPLITS[:steps]):
        epoch, in_epoch = divmod(s * G, epoch_samples) if epoch_samples else (0, 0)
        step = []
        for rank in range(size):
            adapters[rank].set_data_parallel(size, rank, Position(epoch, in_epoch, s * G, G))
            it = iter(adapters[rank].loader)
            for _ in range(G // (size * M)):
                step += ids(next(it))
        out.append(sorted(step))
    return out


# ---- LitData ------------------------------------------------------------------------------------------------------
def _litdata_loader(folder, rank: int, size: int = W, drop_last: bool = True):
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader
    from litdata.utilities.env import _DistributedEnv

    data = StreamingDataset(str(folder), item_loader=TokensLoader(block_size=17), shuffle=True, seed=3,
                            drop_last=drop_last)
    data.distributed_env = _DistributedEnv(size, rank, 1)  # what each rank of a 4-process world detects
    return StreamingDataLoader(data, batch_size=M)


def test_litdata_reads_its_canonical_order_through_every_split_and_epoch(tmp_path):
    pytest.importorskip("litdata")
    folder = write_litdata(tmp_path / "lit", 101)  # LitData cuts each epoch to 96: 12 whole batches on each rank
    loaders = [_litdata_loader(folder, r) for r in range(W)]
    plain = []
    for _ in range(2):  # two epochs of LitData on its own, 4 ranks
        plain += _steps_of_plain_ranks([[b[:, 0].tolist() for b in loader] for loader in loaders], 4)
    assert len(set(sum(plain[:4], []))) == 96 and sum(plain[:4], []) != sum(plain[4:], [])
    adapters = [adapt(_litdata_loader(folder, r % W), W, r % W, _remake) for r in range(W)]
    assert adapters[0].epoch_samples(0) == 96
    got = _read_switching(adapters, len(SPLITS), 96, lambda b: b[:, 0].tolist())
    assert got == plain


def test_litdata_refuses_what_it_cannot_read_in_whole_micro_batches(tmp_path):
    pytest.importorskip("litdata")
    uneven = adapt(_litdata_loader(write_litdata(tmp_path / "lit", 98), 0, drop_last=False), W, 0, _remake)
    assert not uneven.owns_position  # LitData's own split and resume, as without dynatrain
    with pytest.raises(ValueError, match="drop_last=True"):
        uneven.check(2, G)
    tail = adapt(_litdata_loader(write_litdata(tmp_path / "tail", 104), 0), W, 0, _remake)
    tail.check(2, G)
    with pytest.raises(ValueError, match="short step of 8 samples"):
        tail.check(3, G)  # 104 = 4 steps of 24 + 8, and 8 samples do not split in whole micro-batches over 3


# ---- Hugging Face -------------------------------------------------------------------------------------------------
def _hf_split(folder, rank: int, size: int = W):
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    files = sorted(str(p) for p in folder.glob("*.jsonl"))
    data = load_dataset("json", data_files=files, streaming=True, split="train").shuffle(seed=7, buffer_size=8)
    return split_dataset_by_node(data.with_format("torch"), rank=rank, world_size=size)


def _endless(split):
    epoch = 0
    while True:
        split.set_epoch(epoch)
        yield from (int(x["id"]) for x in split)
        epoch += 1


@pytest.mark.parametrize("shards", [8, 6], ids=["shards-per-rank", "examples-per-rank"])
def test_hf_keeps_reading_the_first_splits_readers(tmp_path, shards):
    pytest.importorskip("datasets")
    folder = write_jsonl(tmp_path / "hf", 96, shards)
    readers = [_endless(_hf_split(folder, r)) for r in range(W)]
    plain = [sorted(next(r) for r in readers for _ in range(G // W)) for _ in range(len(SPLITS))]
    adapters = [adapt(DataLoader(_hf_split(folder, r % W), batch_size=M), W, r % W, _remake) for r in range(W)]
    got = _read_switching(adapters, len(SPLITS), None, lambda b: b["id"].tolist())
    assert got == plain
    # a process that takes over (a joiner, a resume) from the saved state reads from the right sample on
    late = adapt(DataLoader(_hf_split(folder, 1), batch_size=M), W, 1, _remake)
    late.load_state_dict(adapters[0].state_dict())
    late.set_data_parallel(3, 1, Position(0, 0, 5 * G, G))
    first = [int(i) for _ in range(G // (3 * M)) for i in next(iter(late.loader))["id"]]
    assert set(first) < set(plain[5]) and len(first) == G // 3


def test_hf_refuses_dataloader_workers(tmp_path):
    pytest.importorskip("datasets")
    reason = adapt(DataLoader(_hf_split(write_jsonl(tmp_path / "hf", 8, 4), 0), batch_size=M, num_workers=2),
                   W, 0, _remake)
    assert isinstance(reason, str) and "num_workers=0" in reason


# ---- refusals -----------------------------------------------------------------------------------------------------
def test_what_no_adapter_takes_is_refused_with_what_to_change(tmp_path):
    class Plain(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    assert "set_data_parallel" in adapt(DataLoader(Plain()), W, 0, _remake)
    mosaic = type("StreamingDataset", (IterableDataset,), {"__iter__": lambda self: iter(())})
    mosaic.__module__ = "streaming.base.dataset"  # MosaicML Streaming's class, without installing it
    reason = adapt(DataLoader(mosaic()), W, 0, _remake)
    assert "MosaicML" in reason and "re-partitions a running dataset" in reason
    assert "persistent_workers=False" in adapt(DataLoader(Plain(), num_workers=1, persistent_workers=True), W, 0,
                                               _remake)
    litdata = pytest.importorskip("litdata")
    folder = write_litdata(tmp_path / "lit", 16)
    parts = [litdata.StreamingDataset(str(folder), item_loader=litdata.TokensLoader(block_size=17)) for _ in range(2)]
    combined = litdata.CombinedStreamingDataset(parts)
    assert "StreamingDataset alone" in adapt(litdata.StreamingDataLoader(combined), W, 0, _remake)


def test_a_stateful_loaders_shuffle_reads_as_distributed_samplers():
    sampler_module = pytest.importorskip("torchdata.stateful_dataloader.sampler")
    from dynatrain.data.streams.torchdata import plain_shuffle

    data = list(range(10))
    assert plain_shuffle(sampler_module.RandomSampler(data), data)
    assert not plain_shuffle(sampler_module.RandomSampler(data, replacement=True), data)
    assert not plain_shuffle(types.SimpleNamespace(), data)
