"""Tokenizers: a byte-level one that needs no download, and an optional `tokenizers` JSON file."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the model need from a tokenizer."""

    vocab_size: int
    eos_id: int | None

    @property
    def identity(self) -> str:
        """A string that changes whenever the same text would give different ids (keys the token cache)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then the specials BOS=256, EOS=257, PAD=258.

    Every string round-trips exactly, there is nothing to download, and the vocabulary (259) fits the
    debug model's 512 embedding rows.
    """

    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = 259
    bos_id: int | None = BOS
    eos_id: int | None = EOS
    pad_id: int | None = PAD

    @property
    def identity(self) -> str:
        return "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        # uint16 rather than uint8: the stream also carries the specials (>= 256).
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise ValueError(f"token id {bad} is outside the byte tokenizer's vocabulary 0..{self.vocab_size - 1}")
        # Specials carry no text; a model may also emit a cut multi-byte sequence, hence errors="replace".
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (for example a model's `tokenizer.json`).

    `tokenizers` is imported here, not at package import, so the default path needs no extra dependency.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(self.path)!r} does not exist; pass the path of a "
                                    "`tokenizers` JSON file (tokenizer.json) or 'byte'")
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as err:
            raise ImportError(
                f"loading the tokenizer {str(self.path)!r} needs the `tokenizers` package: "
                "run `pip install tokenizers` (or `pip install 'dynatrain[tokenizers]'`), "
                "or use the built-in byte tokenizer (tokenizer: byte)"
            ) from err
        try:
            self._tok = _Tok.from_file(str(self.path))
        except Exception as err:  # the Rust side raises a bare Exception on a malformed file
            raise ValueError(f"{str(self.path)!r} is not a valid `tokenizers` JSON file: {err}") from err
        self.vocab_size: int = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.bos_id = self._first_known(_BOS_NAMES)
        self.eos_id = self._first_known(_EOS_NAMES)
        self.pad_id = self._first_known(_PAD_NAMES)
        self._identity = "hf-" + hashlib.sha256(self.path.read_bytes()).hexdigest()[:24]

    def _first_known(self, names: Sequence[str]) -> int | None:
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        return None

    @property
    def identity(self) -> str:
        return self._identity

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_array(self, text: str) -> np.ndarray:
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        return np.asarray(self.encode(text), dtype=dtype)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def load_tokenizer(spec: str | None) -> ByteTokenizer | HFTokenizer:
    """None or "byte" gives the byte tokenizer; a path to a `.json` file gives an `HFTokenizer`."""
    if spec is None or spec.strip().lower() == "byte":
        return ByteTokenizer()
    if spec.endswith(".json") or Path(spec).expanduser().is_file():
        return HFTokenizer(spec)
    raise ValueError(f"unknown tokenizer {spec!r}: use 'byte' (the default) or the path of a `tokenizers` "
                     "JSON file such as tokenizer.json")


def check_vocab(tokenizer: Tokenizer | int, model_vocab_size: int) -> None:
    """Refuse a model whose embedding has fewer rows than the tokenizer can emit.

    `tokenizer` may also be a plain vocabulary size (for pre-tokenized data: largest id + 1).
    """
    needed = tokenizer if isinstance(tokenizer, int) else int(tokenizer.vocab_size)
    if model_vocab_size < needed:
        what = "the data" if isinstance(tokenizer, int) else repr(tokenizer)
        raise ValueError(
            f"the model's vocab_size is {model_vocab_size} but {what} needs {needed} token ids: "
            f"use a model config with vocab_size >= {needed} or a tokenizer with a smaller vocabulary"
        )
