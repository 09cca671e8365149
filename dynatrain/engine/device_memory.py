"""A switch's memory as a GPU's caching allocator sees it, and the one case where the engine gives its cache back.

The engine's live-byte count (`stats.LiveBytes`) is what it holds; on a GPU the process holds what PyTorch's caching
allocator has reserved from the driver, and that can be more: a freed source's block stays reserved, and serves a
later request only if that request fits in it (blocks of different segments never merge), so a switch that frees
row shards and allocates column shards of other sizes can reserve both. NCCL's own buffers (communicators made during
or after the switch) come from the driver, outside the cache, and fail when the cache holds the memory.

So on CUDA every allocation of the engine asks `DeviceMemory.make_room` first: when reserving the request anew would
take the reserved bytes past the bound (reserved at the start plus what the bound lets the switch add beyond its
sources), and the cache holds free blocks, those are given back (`torch.cuda.empty_cache`). Never otherwise: it
waits for the device, and gives back the step's own working memory too, which the next step then reserves again.
The bound is that of the live bytes plus the allocator's rounding (`ROUNDING_BYTES`); the report carries the
allocator's own peaks (`max_memory_allocated`, `max_memory_reserved`) beside it, reset at the switch's start.
"""

from __future__ import annotations

import torch

# The caching allocator's granularity (c10/cuda/CUDACachingAllocator.cpp): requests up to 1 MiB share 2 MiB segments,
# requests below 10 MiB take 20 MiB ones, larger ones are rounded up to 2 MiB. What it reserves beyond the bytes asked
# for is at most one partly used segment of each pool at a time, plus a request's rounding.
_SMALL, _SMALL_SEGMENT, _LARGE_SEGMENT, _MIN_LARGE, _ROUND_LARGE = 1 << 20, 2 << 20, 20 << 20, 10 << 20, 2 << 20
ROUNDING_BYTES = _SMALL_SEGMENT + _LARGE_SEGMENT + _ROUND_LARGE


def segment_bytes(nbytes: int) -> int:
    """What the caching allocator reserves from the driver when no cached block can serve a request of ``nbytes``."""
    if nbytes <= _SMALL:
        return _SMALL_SEGMENT
    if nbytes < _MIN_LARGE:
        return _LARGE_SEGMENT
    return -(-nbytes // _ROUND_LARGE) * _ROUND_LARGE


def must_release(reserved: int, allocated: int, nbytes: int, limit: int) -> bool:
    """Whether to give the cache back before a request of ``nbytes``: reserving it anew would pass ``limit``, and the
    cache holds free blocks (``reserved - allocated``) whose release could make room."""
    return reserved + segment_bytes(nbytes) > limit and reserved > allocated


class DeviceMemory:
    """The caching allocator around one rank's transfer on ``device`` (inactive on any other device type).

    ``growth``: what the engine's bound lets it add beyond its sources (bound minus sources)."""

    def __init__(self, device: torch.device, growth: int) -> None:
        self.device = device
        self.active = device.type == "cuda"
        self.releases = 0
        if not self.active:
            return
        torch.cuda.synchronize(device)  # the figures of the work queued before the switch, not a part of it
        self.start_allocated = torch.cuda.memory_allocated(device)
        self.start_reserved = torch.cuda.memory_reserved(device)
        # The peaks from here on are the switch's: a user's own reading of them spans from the switch on.
        torch.cuda.reset_peak_memory_stats(device)
        self.limit = self.start_reserved + max(growth, 0) + ROUNDING_BYTES

    def make_room(self, nbytes: int) -> None:
        """Before the engine allocates ``nbytes``: give the cache back if keeping it would pass the bound."""
        if not self.active or nbytes <= 0:
            return
        if must_release(torch.cuda.memory_reserved(self.device), torch.cuda.memory_allocated(self.device), nbytes,
                        self.limit):
            torch.cuda.empty_cache()
            self.releases += 1

    def figures(self) -> dict:
        """The allocator's view of the transfer for `TransitionStats` (None off CUDA)."""
        if not self.active:
            return {}
        return {"device_start_allocated": self.start_allocated, "device_start_reserved": self.start_reserved,
                "device_peak_allocated": torch.cuda.max_memory_allocated(self.device),
                "device_peak_reserved": torch.cuda.max_memory_reserved(self.device),
                "device_reserved_bound": self.limit, "cache_releases": self.releases}
