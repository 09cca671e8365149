import itertools

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dynatrain.data.sampler import GlobalBatchSampler, ShardedEvalSampler

N, G, M, SEED = 100, 24, 2, 7  # 4 steps per epoch, 4 samples dropped


def reference_batch(step, n=N, g=G, seed=SEED):
    """Global batch `step`, computed from the definition and not from the sampler."""
    per_epoch = n // g
    epoch, k = divmod(step, per_epoch)
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    return torch.randperm(n, generator=gen)[k * g : (k + 1) * g].tolist()


def make_ranks(dp_size, m=M, g=G, n=N):
    return [GlobalBatchSampler(n, g, m, dp_size, r, seed=SEED) for r in range(dp_size)]


def take(iterator, count):
    out = list(itertools.islice(iterator, count))
    assert len(out) == count, "the sampler ran out early"
    return out


def step_from_ranks(iterators, dp_size, m=M, g=G):
    """Run one global step on every rank and flatten what they read by (a, d, j)."""
    accumulation = g // (dp_size * m)
    per_rank = [take(it, accumulation * m) for it in iterators]
    return [per_rank[d][a * m + j] for a in range(accumulation) for d in range(dp_size) for j in range(m)]


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_same_global_batches_for_every_dp_size(dp_size):
    samplers = make_ranks(dp_size)
    iterators = [iter(s) for s in samplers]
    for step in range(4):
        assert step_from_ranks(iterators, dp_size) == reference_batch(step)
    assert all(next(it, None) is None for it in iterators), "one pass of iter() is one epoch"
    assert all(s.consumed_samples == 4 * G for s in samplers)


def test_epoch_is_a_shuffle_without_repeats_and_drops_the_remainder():
    (sampler,) = make_ranks(1)
    epoch0 = list(sampler)
    assert len(epoch0) == len(sampler) == 96 and len(set(epoch0)) == 96
    epoch1 = list(sampler)  # the position moved on to the next epoch by itself
    assert epoch1 == sum((reference_batch(s) for s in range(4, 8)), [])
    assert epoch1 != epoch0 and sorted(epoch0) != list(range(96))


def test_accumulation_len_and_remaining():
    s = GlobalBatchSampler(N, G, M, dp_size=3, dp_rank=2, seed=SEED)
    assert s.accumulation == 4 and len(s) == 32 and s.remaining_in_epoch() == 32
    take(iter(s), 8)  # one step: 4 micro-batches of 2
    assert s.consumed_samples == G and s.remaining_in_epoch() == 24 and len(s) == 32
    assert isinstance(s, DistributedSampler) and s.num_replicas == 3 and s.rank == 2


def test_layout_switch_continues_at_the_next_global_sample():
    four = make_ranks(4)
    iterators = [iter(s) for s in four]
    for step in range(3):
        assert step_from_ranks(iterators, 4) == reference_batch(step)
    # Ranks 0 and 1 stay and switch to D=2 on the step boundary; their running iterators pick it up.
    for r in (0, 1):
        four[r].set_layout(2, r)
    assert four[0].accumulation == 6
    assert step_from_ranks(iterators[:2], 2) == reference_batch(3)
    # The next epoch continues with the new layout.
    iterators = [iter(four[0]), iter(four[1])]
    assert step_from_ranks(iterators, 2) == reference_batch(4)


def test_scale_out_joiner_starts_from_a_peer_state():
    two = make_ranks(2)
    iterators = [iter(s) for s in two]
    step_from_ranks(iterators, 2)
    joiner = GlobalBatchSampler(N, G, M, dp_size=3, dp_rank=2, seed=SEED)
    joiner.load_state_dict(two[0].state_dict())
    for r in (0, 1):
        two[r].set_layout(3, r)
    assert step_from_ranks(iterators + [iter(joiner)], 3) == reference_batch(1)


@pytest.mark.parametrize("new_dp", [1, 2, 3])
def test_resume_on_a_different_dp_size_gives_the_same_batches(new_dp):
    old = make_ranks(4)
    iterators = [iter(s) for s in old]
    for step in range(3):
        step_from_ranks(iterators, 4)
    state = old[0].state_dict()
    assert state["consumed_samples"] == 3 * G
    resumed = make_ranks(new_dp)
    for s in resumed:
        s.load_state_dict(state)
    iterators = [iter(s) for s in resumed]
    assert step_from_ranks(iterators, new_dp) == reference_batch(3)
    iterators = [iter(s) for s in resumed]  # epoch boundary
    for step in (4, 5):
        assert step_from_ranks(iterators, new_dp) == reference_batch(step)


def test_resume_with_other_settings_is_refused():
    s = GlobalBatchSampler(N, G, M, seed=SEED)
    for key, value in [("global_batch_size", 48), ("num_train_samples", 99), ("seed", 8)]:
        with pytest.raises(ValueError, match=key):
            s.load_state_dict({**s.state_dict(), key: value})
    with pytest.raises(ValueError, match="multiple of global_batch_size=24"):
        s.seek(25)


def test_bad_global_batch_size_names_the_ones_that_work():
    with pytest.raises(ValueError, match="multiple of 8 such as 16 or 24"):
        GlobalBatchSampler(N, 20, 2, dp_size=4, dp_rank=0)
    s = GlobalBatchSampler(N, G, M, dp_size=4, dp_rank=0)
    with pytest.raises(ValueError, match="multiple of 10"):
        s.set_layout(5, 0)
    assert s.dp_size == 4, "a refused layout must leave the old one in place"
    with pytest.raises(ValueError, match="dp_rank"):
        s.set_layout(2, 2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(10, G, M)


def test_micro_batch_change_keeps_the_global_batch():
    s = GlobalBatchSampler(N, G, 4, seed=SEED)
    it = iter(s)
    assert take(it, G) == reference_batch(0)
    s.set_micro_batch_size(3)
    assert s.accumulation == 8
    assert take(it, G) == reference_batch(1)


def test_set_epoch_does_not_move_the_position():
    s = GlobalBatchSampler(N, G, M, seed=SEED)
    take(iter(s), G)
    s.set_epoch(3)  # Lightning's counter may run ahead (a fit stopped by max_steps ends its epoch)
    assert s.consumed_samples == G and s.epoch == 0
    assert take(iter(s), 3 * G) == sum((reference_batch(k) for k in (1, 2, 3)), [])
    assert s.epoch == 1


def test_step_counter_ignores_what_was_fetched_ahead():
    steps = {"done": 0}
    s = GlobalBatchSampler(N, G, M, seed=SEED)
    s.attach_step_counter(lambda: steps["done"])
    it = iter(s)
    take(it, G + 4)  # one step trained, plus two micro-batches of the next fetched ahead
    steps["done"] = 1
    assert s.consumed_samples == G and s.state_dict()["consumed_samples"] == G
    # A switch re-syncs to the committed position; a fresh iterator repeats nothing and skips nothing.
    s.seek(s.consumed_samples)
    s.set_layout(2, 1)
    assert take(iter(s), 12) == GlobalBatchSampler(N, G, M, 2, 1, seed=SEED).rank_indices(1)


def test_seek_mid_step_takes_effect_at_the_next_index():
    s = GlobalBatchSampler(N, G, M, seed=SEED)
    it = iter(s)
    take(it, 5)
    s.seek(2 * G)
    assert take(it, G) == reference_batch(2)


class IndexDataset(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor(i)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_real_dataloader_gives_each_rank_its_micro_batches(num_workers):
    dp = 2
    loaders = [DataLoader(IndexDataset(), batch_size=M, sampler=s, num_workers=num_workers) for s in make_ranks(dp)]
    per_rank = [[b.tolist() for b in loader] for loader in loaders]
    accumulation = G // (dp * M)
    assert all(len(batches) == len(loader) == 4 * accumulation for batches, loader in zip(per_rank, loaders))
    for step in range(4):
        flat = [per_rank[d][step * accumulation + a][j] for a in range(accumulation) for d in range(dp)
                for j in range(M)]
        assert flat == reference_batch(step)


def test_dataloader_stopped_after_a_step_has_the_next_position():
    s = GlobalBatchSampler(N, G, M, dp_size=2, dp_rank=0, seed=SEED)
    loader = DataLoader(IndexDataset(), batch_size=M, sampler=s)
    for n, _ in enumerate(loader, start=1):
        if n == s.accumulation * 2:
            break
    assert s.consumed_samples == 2 * G


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_eval_shards_are_equal_disjoint_and_layout_free(dp_size):
    shards = [list(ShardedEvalSampler(N, dp_size, r, multiple_of=G)) for r in range(dp_size)]
    assert len({len(s) for s in shards}) == 1, "every rank must run the same number of batches"
    union = sorted(sum(shards, []))
    assert union == list(range(96))  # the same 96 windows for every valid D


def test_eval_shards_with_less_data_than_a_global_batch():
    shards = [list(ShardedEvalSampler(10, 3, r, multiple_of=G)) for r in range(3)]
    assert shards == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
