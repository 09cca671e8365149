"""`IterableTokenWindows`: the `set_data_parallel` protocol splits one global stream round-robin, re-split between
steps without skipping or repeating a sample."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dynatrain.data.iterable import DataParallelIterable, IterableTokenWindows

TOKENS = np.arange(1000, dtype=np.int64) % 251


def _first(dataset, n):
    it = iter(dataset)
    return [int(next(it)[0][0]) for _ in range(n)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_read_the_global_stream_round_robin(shuffle):
    whole = IterableTokenWindows(TOKENS, 8, shuffle=shuffle, seed=3)
    assert isinstance(whole, DataParallelIterable)
    stream = _first(whole, 40)  # 124 windows: the first 40 global samples, one epoch's order
    for size in (2, 4):
        for rank in range(size):
            part = IterableTokenWindows(TOKENS, 8, shuffle=shuffle, seed=3)
            part.set_data_parallel(size, rank, 0)
            assert _first(part, 40 // size) == stream[rank::size]


def test_a_running_stream_is_re_split_from_the_next_global_sample():
    whole = _first(IterableTokenWindows(TOKENS, 8, shuffle=True, seed=1), 48)
    ranks = [IterableTokenWindows(TOKENS, 8, shuffle=True, seed=1) for _ in range(4)]
    iters = []
    for r, d in enumerate(ranks):
        d.set_data_parallel(4, r, 0)
        iters.append(iter(d))
    read = [[int(next(it)[0][0]) for _ in range(3)] for it in iters]  # 12 global samples, 3 a rank
    for r, d in enumerate(ranks[:3]):  # a scale-in to 3 ranks at global sample 12
        d.set_data_parallel(3, r, 12)
    after = [[int(next(it)[0][0]) for _ in range(4)] for it in iters[:3]]
    got = sorted(i for part in read + after for i in part)
    assert got == sorted(whole[:24])


def test_epochs_follow_one_another_in_a_new_order():
    d = IterableTokenWindows(TOKENS, 8, shuffle=True, seed=2)
    n = len(d.windows)
    first = [d.window_of(g) for g in range(n)]
    second = [d.window_of(g) for g in range(n, 2 * n)]
    assert sorted(first) == sorted(second) == list(range(n)) and first != second


def test_dataloader_workers_split_a_ranks_micro_batches():
    d = IterableTokenWindows(TOKENS, 8, batch_size=2)
    d.set_data_parallel(2, 1, 0)
    loader = DataLoader(d, batch_size=2, num_workers=2)
    it = iter(loader)
    batches = [next(it)[0][:, 0].tolist() for _ in range(4)]
    ref = IterableTokenWindows(TOKENS, 8)
    ref.set_data_parallel(2, 1, 0)
    assert [i for b in batches for i in b] == _first(ref, 8)
    with pytest.raises(ValueError, match="batch_size"):
        next(iter(DataLoader(IterableTokenWindows(TOKENS, 8), batch_size=2, num_workers=2)))


def test_the_embedded_corpus_is_such_a_stream():
    d = IterableTokenWindows.embedded(seq_len=16, max_corpus_bytes=20_000)
    assert isinstance(d, DataParallelIterable) and len(d.windows) > 100
    d.set_data_parallel(2, 1, 10)
    tokens, labels = next(iter(d))
    assert tokens.shape == labels.shape == (16,) and torch.equal(tokens[1:], labels[:-1])
    assert torch.equal(tokens, d.windows[11][0])
