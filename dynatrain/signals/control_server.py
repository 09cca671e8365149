"""The control server: ``POST /scale`` over HTTP, with a token, queues a request on a :class:`SignalHub`.

``dynatrain scale`` is its client. Only mistakes that can be fixed before training starts raise (no token, a
host beyond loopback without ``allow_remote``); a bad request is answered with the reason and training goes on.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from dynatrain.runtime.addresses import is_loopback
from dynatrain.signals.hub import SignalHub
from dynatrain.signals.request import MAX_BODY, PAYLOAD_EXAMPLE, ScaleRequest, is_int, request_from_payload

LOGGER = logging.getLogger("dynatrain.elastic")


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
        if not is_int(max_body) or max_body < 1:
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
