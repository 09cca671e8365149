"""The engine's memory bound on a GPU's caching allocator (`engine.device_memory`), checked on CPU against a model of
that allocator (freed blocks cached and reused only by requests that fit in them; `empty_cache` returns them), and
the CPU path left as it was (no allocator figures)."""

from __future__ import annotations

import torch

from dynatrain.engine import device_memory
from dynatrain.engine.device_memory import ROUNDING_BYTES, DeviceMemory, must_release, segment_bytes

MiB = 1 << 20


def test_requests_round_to_the_allocators_segments():
    assert segment_bytes(512) == segment_bytes(MiB) == 2 * MiB
    assert segment_bytes(MiB + 1) == segment_bytes(10 * MiB - 1) == 20 * MiB
    assert segment_bytes(10 * MiB) == 10 * MiB and segment_bytes(10 * MiB + 1) == 12 * MiB


def test_the_cache_is_given_back_only_when_reserving_would_pass_the_bound_and_it_holds_free_blocks():
    assert not must_release(reserved=100 * MiB, allocated=50 * MiB, nbytes=20 * MiB, limit=200 * MiB)
    assert must_release(reserved=190 * MiB, allocated=50 * MiB, nbytes=20 * MiB, limit=200 * MiB)
    assert not must_release(reserved=190 * MiB, allocated=190 * MiB, nbytes=20 * MiB, limit=200 * MiB)  # none free


class FakeAllocator:
    """Reserved segments, each one block: a request takes the smallest free cached block that holds it, else a new
    segment of `segment_bytes`; a free caches its block; `empty_cache` returns every free block."""

    def __init__(self, blocks: list[int]) -> None:
        self.used: list[int] = list(blocks)  # segment sizes in use
        self.cached: list[int] = []
        self.peak_reserved = self.reserved()
        self.releases = 0

    def reserved(self) -> int:
        return sum(self.used) + sum(self.cached)

    def allocated(self) -> int:
        return sum(self.used)

    def alloc(self, n: int) -> None:
        fits = sorted(b for b in self.cached if b >= n)
        if fits:
            self.cached.remove(fits[0])
            self.used.append(fits[0])
        else:
            self.used.append(segment_bytes(n))
        self.peak_reserved = max(self.peak_reserved, self.reserved())

    def free(self, n: int) -> None:
        self.used.remove(segment_bytes(n))
        self.cached.append(segment_bytes(n))

    def empty_cache(self) -> None:
        self.cached.clear()
        self.releases += 1

    def install(self, monkeypatch) -> None:
        cuda = device_memory.torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda *a: None)
        monkeypatch.setattr(cuda, "memory_reserved", lambda *a: self.reserved())
        monkeypatch.setattr(cuda, "memory_allocated", lambda *a: self.allocated())
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda *a: self.peak_reserved)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: self.allocated())
        monkeypatch.setattr(cuda, "empty_cache", self.empty_cache)


def switch(monkeypatch, release: bool) -> FakeAllocator:
    """Row shards freed, column shards of another size allocated, one at a time (as the engine frees a source
    after its last send): 8 of 64 MiB become 8 of 80 MiB, with a 32 MiB budget."""
    src, dst = [64 * MiB] * 8, [80 * MiB] * 8
    fake = FakeAllocator(src)
    fake.install(monkeypatch)
    bound = max(sum(src), sum(dst)) + 32 * MiB
    memory = DeviceMemory(torch.device("cuda"), bound - sum(src))
    for s, d in zip(src, dst):
        fake.free(s)
        if release:
            memory.make_room(d)
        fake.alloc(d)
    fig = memory.figures()
    assert fig["device_reserved_bound"] == sum(src) + bound - sum(src) + ROUNDING_BYTES
    assert fig["cache_releases"] == fake.releases
    return fake


def test_freed_shards_are_returned_once_the_cache_would_pass_the_bound(monkeypatch):
    kept = switch(monkeypatch, release=False)
    bound = 8 * 80 * MiB + 32 * MiB + ROUNDING_BYTES
    assert kept.peak_reserved > bound  # every freed row shard still reserved beside the new column shards
    returned = switch(monkeypatch, release=True)
    assert returned.peak_reserved <= bound
    assert 0 < returned.releases < 8  # returned when needed, not at every allocation


def test_a_cpu_transfer_reports_no_allocator_figures():
    from dynatrain.engine import run_transition, torch_dtype
    from dynatrain.models.specs import layout_for_model
    from dynatrain.planner.schedule import plan_switch
    from dynatrain.vps import ParallelConfig

    old = layout_for_model("debug", ParallelConfig.parse("dp_shard=1"))
    plan = plan_switch(old, "dp_shard=1", budget_bytes=MiB, rank_map="identity")
    src = {s.name: torch.ones(old.shards(s.name, 0).local_shape, dtype=torch_dtype(s.dtype)) for s in old.states}
    _, stats = run_transition(plan, 0, src)
    d = stats.as_dict()
    assert d["peak_bytes"] <= d["peak_bound"]
    assert all(d[k] is None for k in ("device_peak_allocated", "device_peak_reserved", "device_reserved_bound",
                                      "cache_releases"))
