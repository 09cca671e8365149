"""`ElasticSampler`: DistributedSampler's split when nothing switches; the same global steps when the split changes."""

import pytest
from torch.utils.data import DistributedSampler, Sampler

from dynatrain.data.elastic_sampler import ElasticSampler, distributed_order


@pytest.mark.parametrize("n", [48, 50, 53])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_without_switches_each_rank_reads_what_distributed_sampler_gives_it(n, shuffle, drop_last):
    dataset = list(range(n))
    for epoch in (0, 3):
        for rank in range(4):
            ref = DistributedSampler(dataset, num_replicas=4, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            ref.set_epoch(epoch)
            mine = ElasticSampler(dataset, micro_batch_size=2, global_batch_size=16, dp_size=4, dp_rank=rank,
                                  shuffle=shuffle, seed=7, drop_last=drop_last)
            mine.set_epoch(epoch)
            assert list(mine) == list(ref)
            assert len(mine) == len(ref)
            assert distributed_order(dataset, 4, shuffle, 7, epoch, drop_last)[rank::4] == list(ref)


def _run(sizes_by_step, n=96, micro=2, glob=24, shuffle=True):
    """Global steps of an epoch read by the ranks as the split changes at the given steps: each step's samples in
    rank-major order, and the micro-batch count of every rank."""
    samplers = {}
    steps = []
    size = sizes_by_step[0]
    ranks = [ElasticSampler(list(range(n)), micro, glob, size, r, shuffle=shuffle, seed=3) for r in range(size)]
    reference = ranks[0]
    iters = [iter(_batches(s, micro)) for s in ranks]
    done = [0] * size
    for step in range(reference.steps_per_epoch):
        if step in sizes_by_step and sizes_by_step[step] != size:
            size = sizes_by_step[step]
            state = ranks[0].state_dict()
            ranks = []
            for r in range(size):
                s = ElasticSampler(list(range(n)), micro, glob, size, r, shuffle=shuffle, seed=3)
                s.load_state_dict(state)
                s.set_layout(size, r, step=step, micro_done=done[0])
                ranks.append(s)
            iters = [iter(_batches(s, micro)) for s in ranks]
            done = [done[0]] * size
        accumulation = glob // (size * micro)
        got = []
        for r, it in enumerate(iters):
            for _ in range(accumulation):
                got.append(next(it))
                done[r] += 1
        steps.append(sorted(i for b in got for i in b))
        samplers = ranks
    return steps, samplers, done


def _batches(sampler, micro):
    batch = []
    for i in sampler:
        batch.append(i)
        if len(batch) == micro:
            yield batch
            batch = []


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_changing_split_keeps_every_global_step_and_the_epoch_end(shuffle):
    static, _, _ = _run({0: 4}, shuffle=shuffle)
    switched, samplers, done = _run({0: 4, 1: 2, 2: 3, 3: 6, 4: 4}, shuffle=shuffle)
    assert switched == static
    # Lightning ends the epoch when its micro-batch count reaches len(loader): the same on every rank.
    assert all(len(s) // 2 == done[0] for s in samplers)


def test_the_global_batch_is_kept_only_where_accumulation_can_keep_it():
    s = ElasticSampler(list(range(96)), micro_batch_size=2, global_batch_size=24, dp_size=4, dp_rank=0)
    assert s.accumulation_for(3) == 4 and s.accumulation_for(12) == 1
    with pytest.raises(ValueError, match="cannot be kept on 5 data-parallel ranks"):
        s.accumulation_for(5)


def test_a_short_last_step_that_another_split_would_weigh_differently_is_refused():
    # 100 samples at D0=4: 4 full steps of 24 and a last one of 4 (one sample per rank: a micro-batch of 1).
    s = ElasticSampler(list(range(100)), micro_batch_size=2, global_batch_size=24, dp_size=4, dp_rank=0)
    with pytest.raises(ValueError, match="short step of 4 samples"):
        s.accumulation_for(2)
    # 104 samples: the last step holds 8 = 4 ranks x one micro-batch of 2, which 2 ranks read as one each too.
    ok = ElasticSampler(list(range(104)), micro_batch_size=2, global_batch_size=24, dp_size=4, dp_rank=0)
    assert ok.accumulation_for(2) == 6


class Reversed(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


def test_a_users_sampler_is_split_in_lightnings_wrapper_order():
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    for rank in range(2):
        ref = DistributedSamplerWrapper(Reversed(40), num_replicas=2, rank=rank, shuffle=True, seed=1)
        mine = ElasticSampler(Reversed(40), 4, 16, 2, rank, shuffle=True, seed=1)
        assert list(mine) == list(ref)


def test_state_dict_resumes_the_position_and_the_reference_split():
    s = ElasticSampler(list(range(96)), 2, 24, 4, 1, seed=5)
    s.set_epoch(2)
    s.seek(3)
    other = ElasticSampler(list(range(96)), 2, 24, 2, 1, seed=5)
    other.load_state_dict(s.state_dict())
    other.set_layout(2, 1)
    assert other.epoch == 2 and other.next_step == 3
    assert list(other) == other.rank_indices(3)
    with pytest.raises(ValueError, match="seed"):
        ElasticSampler(list(range(96)), 2, 24, 2, 1, seed=6).load_state_dict(s.state_dict())
