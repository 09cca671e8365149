"""Resource-change signals of one process: preemption, a control endpoint, a watched file, a scripted trace.

Each source turns what it hears into a :class:`ScaleRequest`. The asynchronous ones (a signal, HTTP, a file) hand
it to a :class:`SignalHub`, which validates it, keeps only the latest (requests arriving between two optimizer
steps are coalesced) and lets the training loop take it with :meth:`SignalHub.poll` at a step boundary. The
scripted :class:`TraceSource` is polled by optimizer step instead, so every rank sees the same entries at the same
step without talking to the others. Agreeing on one request across ranks is the caller's business.

A bad request never raises into training: it is logged on the ``dynatrain.elastic`` logger and kept in
:attr:`SignalHub.rejected`. Only mistakes that can be fixed before training starts raise (a bad trace in a recipe,
a control server asked to listen beyond loopback without ``allow_remote``).

Nothing here imports torch.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import queue
import signal
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable, NamedTuple, Sequence
from urllib.parse import urlsplit

from dynatrain.vps.parallel_config import ParallelConfig

LOGGER = logging.getLogger("dynatrain.elastic")

SOURCES = ("preemption", "control", "file", "trace")
PAYLOAD_EXAMPLE = '{"devices": 3} or {"layout": "dp_shard=2,tp=2"}'
MAX_BODY = 64 * 1024
MAX_REJECTED = 256


# ---------------------------------------------------------------------------------------------------- requests


def describe_request(devices: int | None, layout: str | None, leave: tuple[int, ...]) -> str:
    """``devices=3 layout=... leave=1,2``: the parts a request sets."""
    parts = []
    if devices is not None:
        parts.append(f"devices={devices}")
    if layout is not None:
        parts.append(f"layout={layout}")
    if leave:
        parts.append(f"leave={','.join(map(str, leave))}")
    return " ".join(parts)


@dataclass(frozen=True)
class ScaleRequest:
    """Run on ``devices`` devices, or on ``layout``; ``leave`` are global ranks that are going away.

    A preemption names no target (``devices`` and ``layout`` both None): the job shrinks by the ranks in
    ``leave``. ``deadline`` (``time.monotonic()`` clock) is when the first of them is expected to die.
    The layout is kept in its short form (``"dp_shard=2,tp=2"``), so equal layouts compare equal.
    """

    devices: int | None = None
    layout: str | None = None
    leave: tuple[int, ...] = ()
    source: str = "control"
    reason: str = ""
    received_at: float = field(default_factory=time.monotonic)
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.devices is not None and self.layout is not None:
            raise ValueError(f"give devices or layout, not both (got devices={self.devices!r}, "
                             f"layout={self.layout!r})")
        if self.devices is not None:
            _check_devices(self.devices)
        if self.layout is not None:
            object.__setattr__(self, "layout", _parse_layout(self.layout).short())
        object.__setattr__(self, "leave", _normalise_leave(self.leave))
        if self.devices is None and self.layout is None and not self.leave:
            raise ValueError(f"a scale request needs a target: {PAYLOAD_EXAMPLE}")

    @property
    def parallel_config(self) -> ParallelConfig | None:
        return None if self.layout is None else ParallelConfig.parse(self.layout)

    @property
    def world_size(self) -> int | None:
        """Devices the request asks for; None for a pure preemption, whose size depends on the current world."""
        if self.layout is not None:
            return ParallelConfig.parse(self.layout).world_size
        return self.devices

    def describe(self) -> str:
        return describe_request(self.devices, self.layout, self.leave)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_devices(devices: Any) -> None:
    if not _is_int(devices):
        raise ValueError(f"devices must be an integer, got {devices!r}")
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}: a job cannot run on no device")


def _parse_layout(layout: Any) -> ParallelConfig:
    if not isinstance(layout, str):
        raise ValueError(f"layout must be a string like 'dp_shard=2,tp=2', got {layout!r}")
    return ParallelConfig.parse(layout)


def _normalise_leave(leave: Iterable[Any]) -> tuple[int, ...]:
    ranks = tuple(leave)
    bad = [r for r in ranks if not _is_int(r) or r < 0]
    if bad:
        raise ValueError(f"leave holds global ranks (integers >= 0), got {bad!r}")
    return tuple(sorted(set(ranks)))


def request_from_payload(payload: Any, source: str, reason: str) -> ScaleRequest:
    """The request a JSON document (control body or watched file) asks for; ValueError saying what is wrong."""
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object, {PAYLOAD_EXAMPLE}, got {type(payload).__name__}")
    unknown = sorted(set(payload) - {"devices", "layout"})
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}: send {PAYLOAD_EXAMPLE}")
    if len(payload) != 1:
        raise ValueError(f"give exactly one of 'devices' or 'layout': {PAYLOAD_EXAMPLE}")
    return ScaleRequest(devices=payload.get("devices"), layout=payload.get("layout"), source=source, reason=reason)


def check_limits(request: ScaleRequest, max_devices: int | None) -> None:
    """ValueError when the request asks for more devices than the job may have."""
    size = request.world_size
    if max_devices is not None and size is not None and size > max_devices:
        what = f"layout {request.layout} needs {size} devices" if request.layout else f"devices={size}"
        raise ValueError(f"{what}, above max_devices={max_devices}: ask for at most {max_devices}")


def _coalesce(earlier: ScaleRequest | None, later: ScaleRequest) -> ScaleRequest:
    """The latest target wins, but a rank that announced it is leaving stays gone.

    A pure preemption carries no target, so it keeps the target of the request it joins.
    """
    if earlier is None:
        return later
    deadlines = [d for d in (earlier.deadline, later.deadline) if d is not None]
    target = {} if later.world_size is not None else {"devices": earlier.devices, "layout": earlier.layout}
    return dataclasses.replace(
        later, **target,
        leave=tuple(sorted(set(earlier.leave) | set(later.leave))),
        deadline=min(deadlines) if deadlines else None,
        reason=f"{later.reason} (coalesced with an earlier {earlier.source} request: {earlier.describe()})",
    )


# --------------------------------------------------------------------------------------------------------- hub


class Verdict(NamedTuple):
    accepted: bool
    reason: str


@dataclass(frozen=True)
class Rejection:
    source: str
    reason: str
    request: ScaleRequest | None = None
    received_at: float = field(default_factory=time.monotonic)


class SignalHub:
    """Collects requests from any thread; the training loop takes the latest with :meth:`poll`."""

    def __init__(self, max_devices: int | None = None) -> None:
        if max_devices is not None and (not _is_int(max_devices) or max_devices < 1):
            raise ValueError(f"max_devices must be a positive integer or None, got {max_devices!r}")
        self.max_devices = max_devices
        self._lock = threading.Lock()
        self._pending: ScaleRequest | None = None
        self._rejected: collections.deque[Rejection] = collections.deque(maxlen=MAX_REJECTED)
        self._sources: list[Any] = []
        # A signal handler runs on the main thread between two bytecodes, possibly while that thread holds
        # _lock: it must not take the lock, so it drops its request here and the next poll picks it up.
        self._from_signals: queue.SimpleQueue[ScaleRequest] = queue.SimpleQueue()

    def submit(self, request: ScaleRequest) -> Verdict:
        """Validate against the limits and make ``request`` the pending one (merged with any earlier one)."""
        if not isinstance(request, ScaleRequest):
            return self.reject("unknown", f"not a ScaleRequest: {request!r}")
        try:
            check_limits(request, self.max_devices)
        except ValueError as err:
            return self.reject(request.source, str(err), request)
        with self._lock:
            self._pending = _coalesce(self._pending, request)
        LOGGER.info("scale request from %s queued: %s (%s)", request.source, request.describe(), request.reason)
        return Verdict(True, f"queued {request.describe()}: applied at the next optimizer-step boundary")

    def submit_from_signal_handler(self, request: ScaleRequest) -> None:
        """Queue without locking or logging, both unsafe inside a signal handler; :meth:`poll` submits it."""
        self._from_signals.put(request)

    def reject(self, source: str, reason: str, request: ScaleRequest | None = None) -> Verdict:
        """Record and log a refused request; training goes on."""
        with self._lock:
            self._rejected.append(Rejection(source, reason, request))
        LOGGER.warning("scale request from %s rejected: %s", source, reason)
        return Verdict(False, reason)

    def poll(self) -> ScaleRequest | None:
        """Take the pending request, if any."""
        self._drain_signals()
        with self._lock:
            request, self._pending = self._pending, None
        return request

    def peek(self) -> ScaleRequest | None:
        """The pending request, left pending."""
        self._drain_signals()
        with self._lock:
            return self._pending

    @property
    def rejected(self) -> list[Rejection]:
        """The most recent rejections, oldest first (bounded, so a flood of bad requests cannot grow memory)."""
        with self._lock:
            return list(self._rejected)

    def attach(self, source: Any) -> None:
        """Have :meth:`close` stop ``source`` (anything with a ``close()``)."""
        with self._lock:
            self._sources.append(source)

    def close(self) -> None:
        """Stop every attached source, newest first; the first failure is raised once all were tried."""
        with self._lock:
            sources, self._sources = self._sources[::-1], []
        errors = []
        for source in sources:
            try:
                source.close()
            except Exception as err:  # one broken source must not keep the others running
                LOGGER.exception("closing %r failed", source)
                errors.append(err)
        if errors:
            raise errors[0]

    def __enter__(self) -> "SignalHub":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drain_signals(self) -> None:
        while True:
            try:
                request = self._from_signals.get_nowait()
            except queue.Empty:
                return
            self.submit(request)


# -------------------------------------------------------------------------------------------------- preemption


class PreemptionSource:
    """``signum`` (SIGTERM by default) means "this process goes away within ``grace_seconds``".

    The handler only queues a request with ``leave=(rank,)``; the process keeps running so the job can scale in
    without it before it dies. It replaces whatever handler was installed (Lightning's SIGTERM handler would stop
    training) and puts that one back on :meth:`close`.
    """

    def __init__(self, hub: SignalHub, rank: int, signum: int = signal.SIGTERM, grace_seconds: float = 30.0) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionSource must be created on the main thread: Python lets only the main "
                               "thread install signal handlers")
        if not _is_int(rank) or rank < 0:
            raise ValueError(f"rank must be a global rank (integer >= 0), got {rank!r}")
        if not grace_seconds >= 0:
            raise ValueError(f"grace_seconds must be >= 0, got {grace_seconds!r}")
        self.hub, self.rank, self.signum, self.grace_seconds = hub, rank, signal.Signals(signum), grace_seconds
        self.deadline: float | None = None
        self._previous = signal.signal(self.signum, self._handle)
        self._installed = True
        hub.attach(self)

    def _handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.deadline is None:
            # A repeated signal does not extend the grace period the first one started.
            self.deadline = now + self.grace_seconds
        self.hub.submit_from_signal_handler(ScaleRequest(
            leave=(self.rank,), source="preemption", received_at=now, deadline=self.deadline,
            reason=f"rank {self.rank} received {self.signum.name}; it leaves within {self.grace_seconds:g} s",
        ))

    def close(self) -> None:
        if not self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"close the PreemptionSource on the main thread: only it can restore the "
                               f"{self.signum.name} handler")
        self._installed = False
        if signal.getsignal(self.signum) != self._handle:
            # Someone installed a handler after ours; putting the older one back would silently drop theirs.
            LOGGER.warning("%s handler was replaced after the preemption source installed its own; leaving it",
                           self.signum.name)
            return
        # None means a handler installed outside Python, which cannot be put back from here.
        signal.signal(self.signum, signal.SIG_DFL if self._previous is None else self._previous)


# ------------------------------------------------------------------------------------------------------ control


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address (a name that does not resolve is not)."""
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        pass
    else:
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def _peer_host(handler: BaseHTTPRequestHandler) -> str:
    return handler.client_address[0]


class _Refused(Exception):
    def __init__(self, status: int, reason: str, body_unread: bool = True) -> None:
        super().__init__(reason)
        self.status, self.reason, self.body_unread = status, reason, body_unread


class _Server(ThreadingHTTPServer):
    """Daemon handler threads (a stuck client never blocks interpreter exit), but remembered so close() can
    wait a bounded time for the ones in flight."""

    daemon_threads = True
    block_on_close = False
    control: "ControlServer"

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address), daemon=True)
        self.handler_threads.add(thread)
        thread.start()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.handler_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        super().__init__(*args, **kwargs)


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "dynatrain-control"
    sys_version = ""
    # A client that opens a connection and sends nothing must not hold a thread for ever.
    timeout = 5

    def do_POST(self) -> None:
        self.server.control._serve_post(self)

    def do_GET(self) -> None:
        self.server.control._reply(self, 405, False, "only POST /scale is served", body_unread=False)

    def log_message(self, format: str, *args: Any) -> None:
        LOGGER.debug("control %s: " + format, self.client_address[0], *args)


class ControlServer:
    """``POST /scale`` with ``Authorization: Bearer TOKEN`` and a JSON body queues a request on ``hub``.

    Loopback only unless ``allow_remote`` (the token then travels in clear: keep the network trusted). Bodies
    are JSON of at most ``max_body`` bytes and are only ever parsed as JSON. Answers are
    ``{"accepted": bool, "reason": str}``: 200 queued, 400 malformed, 403 not allowed, 413 too large,
    422 well formed but beyond the job's limits.
    """

    def __init__(self, hub: SignalHub, token: str, host: str = "127.0.0.1", port: int = 0,
                 allow_remote: bool = False, max_body: int = MAX_BODY) -> None:
        if not isinstance(token, str) or not token:
            raise ValueError("the control server needs a non-empty token: without one anyone could rescale the job")
        if not allow_remote and not is_loopback(host):
            raise ValueError(f"host {host!r} is not a loopback address: pass allow_remote=True to accept requests "
                             f"from other machines (only on a trusted network: the token is sent in clear)")
        if not _is_int(max_body) or max_body < 1:
            raise ValueError(f"max_body must be a positive number of bytes, got {max_body!r}")
        self.hub, self.allow_remote, self.max_body = hub, allow_remote, max_body
        self._closed = False
        self._token = token.encode()
        server_class = _IPv6Server if ":" in host else _Server
        self._server = server_class((host.strip("[]"), port), _Handler)
        self._server.control = self
        bound_host, bound_port = self._server.server_address[:2]
        self.endpoint = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"dynatrain-control-{bound_port}", daemon=True)
        self._thread.start()
        if allow_remote and not is_loopback(host):
            LOGGER.warning("control server listens on %s beyond loopback: requests and token are not encrypted",
                           self.endpoint)
        hub.attach(self)

    def close(self, wait_seconds: float = 5.0) -> None:
        """Stop listening, then wait up to ``wait_seconds`` for requests in flight (they are refused from now)."""
        self._closed = True
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
        end = time.monotonic() + wait_seconds
        for thread in list(self._server.handler_threads):
            thread.join(max(0.0, end - time.monotonic()))

    def __enter__(self) -> "ControlServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve_post(self, handler: _Handler) -> None:
        try:
            request = self._read_request(handler)
        except OSError as err:  # the client went silent or away mid-request: there is nobody to answer
            self.hub.reject("control", f"connection from {_peer_host(handler)} dropped while reading: {err}")
            handler.close_connection = True
            return
        except _Refused as refused:
            self.hub.reject("control", f"{refused.reason} (HTTP {refused.status} to {_peer_host(handler)})")
            self._reply(handler, refused.status, False, refused.reason, refused.body_unread)
            return
        verdict = self.hub.submit(request)
        self._reply(handler, 200 if verdict.accepted else 422, verdict.accepted, verdict.reason, body_unread=False)

    def _read_request(self, handler: _Handler) -> ScaleRequest:
        """Checks cheapest first, and nothing of the body is read before the client is known and the size fits."""
        if self._closed:
            raise _Refused(503, "the job no longer takes scale requests")
        if not self.allow_remote and not is_loopback(_peer_host(handler)):
            raise _Refused(403, "requests are accepted from loopback only")
        if urlsplit(handler.path).path != "/scale":
            raise _Refused(404, f"unknown path {urlsplit(handler.path).path!r}: POST /scale")
        if not self._token_ok(handler.headers.get("Authorization", "")):
            raise _Refused(403, "missing or wrong token: send 'Authorization: Bearer TOKEN' with the job's token")
        length = self._content_length(handler)
        content_type = handler.headers.get_content_type()
        if content_type != "application/json":
            raise _Refused(400, f"content type {content_type!r} refused: send application/json")
        body = handler.rfile.read(length)
        if len(body) != length:
            raise _Refused(400, f"body ended after {len(body)} of {length} bytes", body_unread=False)
        return self._parse(body)

    def _token_ok(self, header: str) -> bool:
        scheme, _, given = header.partition(" ")
        # compare_digest keeps the time taken independent of how much of the token a guess got right.
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)

    def _content_length(self, handler: _Handler) -> int:
        if handler.headers.get("Transfer-Encoding"):
            raise _Refused(411, "chunked bodies are not accepted: send Content-Length")
        text = handler.headers.get("Content-Length")
        if text is None:
            raise _Refused(411, "Content-Length is required")
        if not text.strip().isdigit():
            raise _Refused(400, f"bad Content-Length {text!r}")
        length = int(text)
        if length > self.max_body:
            raise _Refused(413, f"body of {length} bytes is over the limit of {self.max_body} bytes")
        return length

    @staticmethod
    def _parse(body: bytes) -> ScaleRequest:
        try:
            payload = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise _Refused(400, f"body is not valid JSON ({err}): send {PAYLOAD_EXAMPLE}", body_unread=False)
        try:
            return request_from_payload(payload, "control", "control command")
        except ValueError as err:
            raise _Refused(400, str(err), body_unread=False) from None

    def _reply(self, handler: _Handler, status: int, accepted: bool, reason: str, body_unread: bool) -> None:
        data = json.dumps({"accepted": accepted, "reason": reason}).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(data)
        handler.close_connection = True
        if body_unread:
            _discard_input(handler)


def _discard_input(handler: _Handler, limit: int = 1 << 20, seconds: float = 2.0) -> None:
    """Let the client finish sending before the socket closes, without keeping what it sends.

    Closing a socket with unread input makes the kernel send a reset, which can destroy the answer before the
    client reads it. So: flush, half-close, then throw incoming bytes away until the client closes, ``limit``
    bytes or ``seconds`` have passed.
    """
    sock = handler.connection
    try:
        handler.wfile.flush()
        sock.shutdown(socket.SHUT_WR)
        end = time.monotonic() + seconds
        while limit > 0 and (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(min(limit, 65536))
            if not chunk:
                return
            limit -= len(chunk)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------------------- file


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


# -------------------------------------------------------------------------------------------------------- trace


class TraceSource:
    """A scripted list of ``(step, devices or layout)`` from a recipe: for experiments and replayed traces.

    Entries are tuples ``(10, 2)`` / ``(10, "dp_shard=2,tp=2")`` or dicts ``{"step": 10, "devices": 2}`` /
    ``{"step": 10, "layout": "..."}``. A bad trace raises ``ValueError`` at construction, naming the entry, so the
    recipe is fixed before any training. :meth:`due` depends only on the step, so every rank agrees without
    communicating.
    """

    def __init__(self, entries: Sequence[Any], max_devices: int | None = None) -> None:
        if isinstance(entries, (str, bytes, dict)) or not isinstance(entries, Sequence):
            raise ValueError(f"a trace is a list of (step, devices or layout) entries, got {entries!r}")
        self.entries: tuple[tuple[int, int | str], ...] = tuple(
            _trace_entry(i, entry, max_devices) for i, entry in enumerate(entries))
        for i in range(1, len(self.entries)):
            if self.entries[i][0] <= self.entries[i - 1][0]:
                raise ValueError(f"trace entry {i} ({entries[i]!r}): step {self.entries[i][0]} does not come after "
                                 f"step {self.entries[i - 1][0]} of entry {i - 1}; list entries in strictly "
                                 f"increasing step order")
        self._next = 0

    def due(self, step: int) -> list[ScaleRequest]:
        """Entries with ``entry step <= step`` not returned before, in order (usually none or one)."""
        out = []
        while self._next < len(self.entries) and self.entries[self._next][0] <= step:
            at, value = self.entries[self._next]
            target = {"devices": value} if _is_int(value) else {"layout": value}
            out.append(ScaleRequest(**target, source="trace", reason=f"trace entry {self._next} at step {at}"))
            self._next += 1
        return out

    @property
    def fired(self) -> int:
        """How many entries :meth:`due` has returned."""
        return self._next

    def __len__(self) -> int:
        return len(self.entries)


def _trace_entry(index: int, entry: Any, max_devices: int | None) -> tuple[int, int | str]:
    try:
        step, value = _split_entry(entry)
        if not _is_int(step) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        request = _trace_target(value)
        check_limits(request, max_devices)
    except ValueError as err:
        raise ValueError(f"trace entry {index} ({entry!r}): {err}") from None
    return step, request.devices if request.devices is not None else request.layout


def _split_entry(entry: Any) -> tuple[Any, Any]:
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - {"step", "devices", "layout"})
        if unknown or "step" not in entry or len(entry) != 2:
            raise ValueError("write it as {step: N, devices: D} or {step: N, layout: 'dp_shard=2,tp=2'}"
                             + (f" (unknown key(s) {', '.join(map(repr, unknown))})" if unknown else ""))
        return entry["step"], entry.get("devices", entry.get("layout"))
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        return entry[0], entry[1]
    raise ValueError("write it as (step, devices) or (step, 'dp_shard=2,tp=2')")


def _trace_target(value: Any) -> ScaleRequest:
    if isinstance(value, str):
        return ScaleRequest(layout=value, source="trace")
    if _is_int(value):
        return ScaleRequest(devices=value, source="trace")
    raise ValueError(f"the target must be a device count (integer >= 1) or a layout string, got {value!r}")
