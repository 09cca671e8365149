"""What one rank did in a switch (`TransitionStats`) and the live-byte count its memory bound is kept by."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TransitionStats:
    """What one rank did in a switch. Bytes are payload bytes (no alignment padding)."""

    rank: int
    rounds: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0  # copied locally (src == dst process), never on the wire
    bytes_kept: int = 0  # local tensors adopted as they are (same box, same shape): no copy at all
    bytes_zero_copy: int = 0  # sent from or received into the local tensor itself, no staging on this side
    src_bytes: int = 0  # this rank's old local tensors
    dst_bytes: int = 0  # this rank's new local tensors
    staging_bytes: int = 0  # the one staging buffer
    flight_bytes: int = 0  # what a phase may hold doubled: half the budget, or this rank's largest local tensor
    peak_bytes: int = 0  # max over the switch of live sources + live destinations + staging
    copy_threads: int | None = None  # intra-op threads of the copies (CPU only)
    # CUDA only (None elsewhere), the caching allocator's bytes (`engine.device_memory`): at the start, their peaks
    # over the transfer, the bound its reserved bytes are kept within, and how often its cache was given back for it.
    device_start_allocated: int | None = None
    device_start_reserved: int | None = None
    device_peak_allocated: int | None = None
    device_peak_reserved: int | None = None
    device_reserved_bound: int | None = None
    cache_releases: int | None = None
    seconds_pack: float = 0.0
    seconds_wire: float = 0.0  # posting and waiting (local copies run while the wire is busy)
    seconds_local: float = 0.0
    seconds_unpack: float = 0.0
    seconds_total: float = 0.0

    @property
    def peak_bound(self) -> int:
        """The bound the engine keeps: max(sources, destinations) + staging + the phase in flight."""
        return max(self.src_bytes, self.dst_bytes) + self.staging_bytes + self.flight_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d["peak_bound"] = self.peak_bound
        return d


class LiveBytes:
    """Live-byte accounting: sources + destinations + staging, with the running peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.now += n
        if self.now > self.peak:
            self.peak = self.now

    def sub(self, n: int) -> None:
        self.now -= n
