"""torchdata's `StatefulDataLoader` over a map-style dataset.

Lightning injects its distributed sampler into it as into a `DataLoader`, and the strategy re-makes it with an
`ElasticSampler` (Lightning's re-instantiation keeps the subclass). One difference: ``shuffle=True`` gives it
torchdata's own `RandomSampler`, which Lightning does not recognise as a shuffle and wraps as a user's sampler, whose
permutation each process draws from its own global RNG (a joiner draws another one). Read as the shuffle it is, the
loader's order is `DistributedSampler`'s with the run's seed, as for ``DataLoader(shuffle=True)``.
"""

from __future__ import annotations


def plain_shuffle(sampler: object, dataset: object) -> bool:
    """Whether ``sampler`` is torchdata's `RandomSampler` over the whole of ``dataset`` without replacement."""
    if type(sampler).__module__.split(".", 1)[0] != "torchdata":
        return False
    from torchdata.stateful_dataloader.sampler import RandomSampler

    return (type(sampler) is RandomSampler and not sampler.replacement and sampler.data_source is dataset
            and sampler.num_samples == len(dataset))
