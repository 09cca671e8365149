"""A watched JSON file: its content is the desired target, submitted to a :class:`SignalHub` when it changes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading

from dynatrain.signals.hub import SignalHub
from dynatrain.signals.request import MAX_BODY, PAYLOAD_EXAMPLE, request_from_payload

LOGGER = logging.getLogger("dynatrain.elastic")


class FileSource:
    """Watch a JSON file (``{"devices": 3}`` or ``{"layout": "..."}``) and submit it whenever it changes.

    The file is the desired state: what it holds when watching starts is submitted too, and touching it submits
    it again; an empty file asks for nothing. Malformed content is rejected once per version of the file, not at
    every poll. Replace the file atomically (write elsewhere, then rename) so a half-written version is never seen.
    """

    def __init__(self, hub: SignalHub, path: str | os.PathLike, poll_seconds: float = 0.5,
                 max_bytes: int = MAX_BODY) -> None:
        if not poll_seconds > 0:
            raise ValueError(f"poll_seconds must be positive, got {poll_seconds!r}")
        self.hub, self.path, self.poll_seconds, self.max_bytes = hub, os.fspath(path), poll_seconds, max_bytes
        self._seen: tuple | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dynatrain-file-{os.path.basename(self.path)}",
                                        daemon=True)
        self._thread.start()
        hub.attach(self)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                self._check()
            except Exception:  # the watcher must outlive any surprise from the file system
                LOGGER.exception("watching %s failed; still watching", self.path)
            if self._stop.wait(self.poll_seconds):
                return

    def _check(self) -> None:
        version, content = self._read()
        if version is None or version == self._seen:
            return
        self._seen = version
        self._submit(content)

    def _read(self) -> tuple[tuple | None, bytes | str | None]:
        """(version, content): version None while the file is absent; content a str when it cannot be used."""
        try:
            stat = os.stat(self.path)
            if stat.st_size > self.max_bytes:
                return (stat.st_mtime_ns, stat.st_size), f"file is {stat.st_size} bytes, over {self.max_bytes}"
            with open(self.path, "rb") as f:
                data = f.read(self.max_bytes + 1)
        except FileNotFoundError:
            # Forget the last version, so writing the same request again after a removal counts as new.
            self._seen = None
            return None, None
        except OSError as err:
            return ("unreadable", str(err)), f"cannot read it: {err}"
        if len(data) > self.max_bytes:
            return (stat.st_mtime_ns, len(data)), f"file is over {self.max_bytes} bytes"
        # The hash catches a rewrite that keeps size and a coarse mtime; mtime catches a touch.
        return (stat.st_mtime_ns, len(data), hashlib.sha256(data).hexdigest()), data

    def _submit(self, content: bytes | str) -> None:
        reason = f"file {self.path}"
        if isinstance(content, bytes) and not content.strip():
            # `echo ... > file` truncates before it writes: an empty file is a write in progress, not a request.
            return
        if isinstance(content, str):
            self.hub.reject("file", f"{reason}: {content}")
            return
        try:
            request = request_from_payload(json.loads(content.decode("utf-8")), "file", reason)
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            self.hub.reject("file", f"{reason}: {err}; write {PAYLOAD_EXAMPLE}")
            return
        self.hub.submit(request)
