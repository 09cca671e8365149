"""Token streams: the embedded default corpus, a folder of text files, or a pre-tokenized `.bin`.

Text sources are tokenised once and cached as `.npy`; the cache key covers every input that changes
the tokens, so a stale cache is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dynatrain.data.tokenizer import Tokenizer
from dynatrain.settings import CACHE_ENV, explicit_or_env

DEFAULT_MAX_CORPUS_BYTES = 4_000_000
"""About 4 MB of the standard library: ~30k windows of 128 bytes, tokenised in well under a second."""

TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".tsv", ".html", ".xml",
                           ".tex", ".c", ".h", ".cpp", ".js", ".ts", ".java", ".go", ".rs", ".sh", ".yaml", ".yml"})

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

_CACHE_FORMAT = 1  # bump when the way a stream is built changes, so old caches are not reused


@dataclass(frozen=True)
class SourceFile:
    path: Path
    relpath: str  # with "/" separators, so the order and the cache key are the same on every OS
    size: int
    mtime_ns: int




def cache_dir(cache: str | Path | None = None) -> Path:
    """Where tokenised text is cached: ``cache`` when given (the datamodule's ``cache_dir``; it wins), else
    `$DYNATRAIN_CACHE` if set, else `~/.cache/dynatrain`."""
    chosen = explicit_or_env(cache, CACHE_ENV)
    return Path(chosen).expanduser() if chosen else Path.home() / ".cache" / "dynatrain"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _walk(root: Path, suffixes: frozenset[str], skip_dirs: frozenset[str]) -> list[SourceFile]:
    found: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda err: None):
        # Pruned in place so os.walk never descends into them; hidden folders hold caches, VCS data, venvs.
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or Path(name).suffix.lower() not in suffixes:
                continue
            path = Path(dirpath) / name
            try:
                st = path.stat()
            except OSError:
                continue
            found.append(SourceFile(path, path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns))
    found.sort(key=lambda f: f.relpath)  # os.walk order depends on the filesystem
    return found


def _cap(files: list[SourceFile], max_bytes: int | None) -> list[SourceFile]:
    """The prefix of `files` that reaches `max_bytes` (the last one is cut when read)."""
    if max_bytes is None or max_bytes <= 0:
        return files
    kept, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        kept.append(f)
        total += f.size
    return kept


def stdlib_files(max_bytes: int | None = DEFAULT_MAX_CORPUS_BYTES) -> list[SourceFile]:
    """The standard library's own `.py` files, sorted, without tests or site-packages, up to `max_bytes`."""
    return _cap(_walk(stdlib_dir(), frozenset({".py"}), _SKIP_DIRS), max_bytes)


def text_files(folder: str | Path, max_bytes: int | None = None) -> list[SourceFile]:
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data folder {str(root)!r} does not exist")
    files = _cap(_walk(root, TEXT_SUFFIXES, frozenset({"__pycache__"})), max_bytes)
    if not files:
        raise ValueError(f"data folder {str(root)!r} holds no text files; expected files ending in "
                         f"{', '.join(sorted(TEXT_SUFFIXES))}")
    return files


def read_documents(files: Iterable[SourceFile], max_bytes: int | None = None) -> Iterable[str]:
    """Each file's text, skipping unreadable ones; the total is cut at `max_bytes` on a line boundary."""
    budget = max_bytes if max_bytes is not None and max_bytes > 0 else None
    for f in files:
        if budget is not None and budget <= 0:
            return
        try:
            raw = f.path.read_bytes()
        except OSError:
            continue
        if budget is not None and len(raw) > budget:
            cut = raw.rfind(b"\n", 0, budget)
            raw = raw[: cut + 1 if cut >= 0 else budget]
        if budget is not None:
            budget -= len(raw)
        # A stray byte in a user's file should not stop a run; it becomes U+FFFD.
        yield raw.decode("utf-8", errors="replace")


def tokenize_documents(documents: Iterable[str], tokenizer: Tokenizer) -> np.ndarray:
    """Documents concatenated, each followed by the tokenizer's EOS (when it has one)."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    eos = None if tokenizer.eos_id is None else np.array([tokenizer.eos_id], dtype=dtype)
    parts: list[np.ndarray] = []
    for doc in documents:
        parts.append(tokenizer.encode_array(doc).astype(dtype, copy=False))
        if eos is not None:
            parts.append(eos)
    if not parts:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(parts)


def cache_key(files: Iterable[SourceFile], max_bytes: int | None, tokenizer: Tokenizer) -> str:
    payload = {
        "format": _CACHE_FORMAT,
        "files": [[f.relpath, f.size, f.mtime_ns] for f in files],
        "max_bytes": max_bytes if max_bytes is not None and max_bytes > 0 else None,
        "tokenizer": tokenizer.identity,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def _atomic_save(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks may build the same cache at once: each writes its own temporary file and
    # os.replace makes one of them appear whole; a reader never sees a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_tokens(files: list[SourceFile], max_bytes: int | None, tokenizer: Tokenizer,
                  cache: Path | None = None, name: str = "tokens") -> np.ndarray:
    """Tokens of `files` (cut at `max_bytes`), read from the cache or built and stored there."""
    cache = cache_dir(cache)
    path = cache / f"{name}-{cache_key(files, max_bytes, tokenizer)}.npy"
    if path.is_file():
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError):
            pass  # a damaged file (disk full while another tool wrote it): rebuild it below
    tokens = tokenize_documents(read_documents(files, max_bytes), tokenizer)
    if tokens.size == 0:
        raise ValueError(f"the {len(files)} source files hold no readable text to train on")
    try:
        _atomic_save(path, tokens)
    except OSError as err:
        warnings.warn(f"could not write the token cache {str(path)!r} ({err}); give the datamodule's cache_dir "
                      "(or set DYNATRAIN_CACHE) a writable folder to avoid tokenising again next time", stacklevel=2)
        return tokens
    return np.load(path, mmap_mode="r")


def embedded_corpus(tokenizer: Tokenizer, max_bytes: int | None = DEFAULT_MAX_CORPUS_BYTES,
                    cache: Path | None = None) -> np.ndarray:
    """The default corpus: this interpreter's standard library sources. No network, real text."""
    files = stdlib_files(max_bytes)
    if not files:
        raise RuntimeError(f"found no .py files under the standard library folder {str(stdlib_dir())!r}; "
                           "pass `data` (a folder of text files or a .bin of tokens) instead")
    return cached_tokens(files, max_bytes, tokenizer, cache, name="stdlib")


def folder_corpus(folder: str | Path, tokenizer: Tokenizer, max_bytes: int | None = None,
                  cache: Path | None = None) -> np.ndarray:
    files = text_files(folder, max_bytes)
    # The folder itself is in the name so that two folders with equal file lists do not collide.
    tag = hashlib.sha256(str(Path(folder).expanduser().resolve()).encode()).hexdigest()[:8]
    return cached_tokens(files, max_bytes, tokenizer, cache, name=f"folder-{tag}")


_BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def bin_dtype_for(path: str | Path, dtype: str | None = None) -> tuple[np.dtype, bool]:
    """The element type of a token file and whether it was guessed (no option, no telling suffix)."""
    if dtype is not None:
        if dtype not in _BIN_DTYPES:
            raise ValueError(f"bin_dtype must be 'uint16' or 'uint32', not {dtype!r}")
        return np.dtype(_BIN_DTYPES[dtype]), False
    name = Path(path).name.lower()
    for key, value in _BIN_DTYPES.items():
        if name.endswith(f".{key}.bin"):
            return np.dtype(value), False
    return np.dtype(np.uint16), True


def load_bin(path: str | Path, dtype: str | None = None, vocab_size: int | None = None) -> np.ndarray:
    """A pre-tokenized file of raw little-endian uint16/uint32 ids, memory-mapped.

    The element type comes from `dtype`, else from a `.uint16.bin`/`.uint32.bin` suffix, else uint16.
    When `vocab_size` is given, every id must be below it.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"token file {str(path)!r} does not exist")
    np_dtype, guessed = bin_dtype_for(path, dtype)
    size = path.stat().st_size
    if size == 0 or size % np_dtype.itemsize:
        raise ValueError(f"{str(path)!r} has {size} bytes, not a whole non-zero number of {np_dtype.name} tokens; "
                         "check bin_dtype (or the .uint16.bin/.uint32.bin suffix)")
    tokens = np.memmap(path, dtype=np_dtype.newbyteorder("<"), mode="r")
    hint = "pass bin_dtype='uint32' or name the file *.uint32.bin if it holds 32-bit tokens"
    if guessed and tokens.size >= 2048:
        head = np.asarray(tokens[: 1 << 20])
        # uint32 ids read as uint16 leave their high halves (0, or 1 above 65535) at every odd position.
        if head[1::2].max() <= 1 < head[0::2].max():
            raise ValueError(f"{str(path)!r} looks like 32-bit tokens read as uint16: {hint}")
    if vocab_size is not None:
        top = int(tokens.max())
        if top >= vocab_size:
            extra = f"; {hint}" if guessed else ""
            raise ValueError(f"{str(path)!r} holds token id {top} but the vocabulary has {vocab_size} ids "
                             f"(0..{vocab_size - 1}): use the tokenizer the file was made with{extra}")
    return tokens
