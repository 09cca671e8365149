"""Fixed-length training windows over one token stream, and the train/validation split."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class TokenWindows(Dataset):
    """Sample i is tokens[i*seq_len : i*seq_len + seq_len + 1], returned as (input_ids, labels).

    Windows do not overlap except for the one token that is both the last label of window i and the
    first input of window i+1, so every token is predicted once per epoch.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self._len = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range for {self._len} windows")
        start = index * self.seq_len
        # int64 because embedding lookups and cross-entropy targets need it; the copy also detaches
        # the sample from a memory-mapped file.
        chunk = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]

    def __getstate__(self) -> dict[str, Any]:
        # Worker processes started with "spawn" pickle the dataset: send the file's name, not its contents.
        state = self.__dict__.copy()
        tokens = self.tokens
        if isinstance(tokens, np.memmap) and tokens.filename is not None:
            root = tokens
            while isinstance(root.base, np.memmap):
                root = root.base
            start = (tokens.__array_interface__["data"][0] - root.__array_interface__["data"][0]) // tokens.itemsize
            state["tokens"] = ("memmap", tokens.filename, tokens.dtype.str, int(tokens.offset), len(root),
                               int(start), len(tokens))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        tokens = state["tokens"]
        if isinstance(tokens, tuple) and tokens and tokens[0] == "memmap":
            _, filename, dtype, offset, root_len, start, length = tokens
            root = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(root_len,))
            state["tokens"] = root[start : start + length]
        self.__dict__.update(state)


def split(tokens: np.ndarray, val_fraction: float, seq_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token streams; validation is the tail, disjoint from every training window.

    With `seq_len`, the validation part is a whole number of windows (at least one when
    `val_fraction > 0`) and the training part must hold at least one window.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = len(tokens)
    if val_fraction == 0.0:
        return tokens, tokens[n:]
    if seq_len is None:
        n_val = int(n * val_fraction)
    else:
        windows = max(0, (n - 1) // seq_len)
        n_val = max(1, round(windows * val_fraction)) * seq_len + 1
    n_train = n - n_val
    if seq_len is not None and n_train < seq_len + 1:
        raise ValueError(f"{n} tokens are too few for seq_len={seq_len} with val_fraction={val_fraction}: "
                         "add data, lower seq_len or lower val_fraction")
    # Training windows read at most tokens[:n_train]; validation starts at n_train: nothing is shared.
    return tokens[:n_train], tokens[n_train:]
