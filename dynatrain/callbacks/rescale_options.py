"""The options of `ElasticCallback`'s sources, checked when the callback is built, and the control token file."""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Mapping
from pathlib import Path


def source_options(value: bool | dict | None, name: str, keys: set[str]) -> dict | None:
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be true, false or a mapping of {', '.join(sorted(keys))}; got {value!r}")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(keys))}")
    return dict(value)


def watch_options(value: str | os.PathLike | dict | None) -> dict | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return {"path": os.fspath(value)}
    opts = source_options(value, "watch_file", {"path", "poll_seconds"})
    if not opts or not opts.get("path"):
        raise ValueError(f"watch_file needs a path, got {value!r}")
    return opts


def signal_number(value: int | str) -> signal.Signals:
    if isinstance(value, str):
        name = value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"
        try:
            return signal.Signals[name]
        except KeyError:
            raise ValueError(f"unknown signal {value!r}") from None
    return signal.Signals(value)


def new_token() -> str:
    """192 random bits in hex: a token that began with '-' (URL-safe base64 does, once in 64) would be read by
    ``dynatrain scale --token TOKEN`` as an option, and the command would exit with a usage error."""
    return secrets.token_hex(24)


def read_or_create_token(path: Path, fresh: bool = False) -> str:
    """The token in ``path``; a new random one written there (owner-only) when missing or ``fresh``."""
    if path.exists() and not fresh:
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"token file {path} is empty")
        return token
    token = new_token()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
