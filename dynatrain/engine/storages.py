"""The memory of a source the engine gives back itself, once nothing of the transition still needs it.

Dropping the engine's reference frees a source only when nobody else holds the tensor, and a live module's sources
are also held by the reference cycles of its parallelisation (FSDP2's modules, states and parameters point at one
another) until a full garbage collection, which walks every object of the process and costs a switch's stall tens
to hundreds of milliseconds. So the engine empties the storage itself (``resize_(0)``) after a source's last use;
whoever still holds the tensor object holds one without bytes, which must not be read (torch does not check it, and
a read faults).

A storage may hold several tensors of the transition: FSDP2's local shards are views of a padded buffer, and a
module's own flat buffer or a tied weight may lie under two states. It is emptied only when the last source on it
is done and nothing that outlives the transition lies on it: a destination (a source adopted as its destination,
a caller's preallocated tensor) or an entry of the caller's dict the plan does not read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import torch

StorageKey = tuple[str, int]


def storage_key(t: torch.Tensor) -> StorageKey | None:
    """Which memory ``t`` lies in; None when it holds none (meta, or no bytes)."""
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return str(t.device), storage.data_ptr()


class SourceStorages:
    """Per storage, how many of the sources not yet done and of the tensors that outlive the transition lie on it."""

    def __init__(self, src: Mapping[str, torch.Tensor], read: Iterable[str],
                 destinations: Iterable[torch.Tensor]) -> None:
        read = set(read)
        self.key_of = {name: storage_key(t) for name, t in src.items() if name in read}
        self.users = Counter(key for key in self.key_of.values() if key is not None)
        unread = [t for name, t in src.items() if name not in read and isinstance(t, torch.Tensor)]
        self.users.update(key for key in map(storage_key, [*unread, *destinations]) if key is not None)

    def done(self, name: str, t: torch.Tensor) -> bool:
        """Source ``name`` (tensor ``t``) is no longer read: empty its storage if nothing else of the transition
        lies on it. Returns whether it was emptied."""
        key = self.key_of.pop(name, None)
        if key is None:
            return False
        self.users[key] -= 1
        if self.users[key] > 0:
            return False
        del self.users[key]
        try:
            t.untyped_storage().resize_(0)
        except RuntimeError:  # memory torch did not allocate (numpy, mmap): it goes with its last reference
            return False
        return True
