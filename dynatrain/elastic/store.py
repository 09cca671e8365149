"""A rendezvous store that outlives every training process.

torchrun's store lives in its agent and dies with it, and a store hosted by rank 0 dies when rank 0 leaves. Here a
small process of its own serves a ``TCPStore``; training processes and joiners are clients only, so any of them,
rank 0 included, may leave. It exits when a client asks it to (:func:`request_shutdown`) or when the launcher
that started it dies, so a crashed job leaves no orphan listening on a port.

Run it directly with ``python -m dynatrain.elastic.store --port 0 --token T --endpoint-file F`` or from Python
with :func:`start_store`. The token is checked by :func:`connect`: the store keeps only a hash of it, so a
process holding the wrong endpoint or token (another job's) is refused before it touches this job's keys. This
guards against mistakes, not attackers: the TCPStore protocol itself has no authentication.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from dynatrain.settings import STORE_TOKEN_ENV, explicit_or_env

TOKEN_KEY = "dynatrain/token_sha256"
SHUTDOWN_KEY = "dynatrain/shutdown"


def _token_hash(token: str) -> bytes:
    return hashlib.sha256(b"dynatrain-store:" + token.encode()).hexdigest().encode()


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"store endpoint {endpoint!r} is not HOST:PORT (e.g. 127.0.0.1:29400)")
    return host.strip("[]"), int(port)


def connect(endpoint: str, token: str, timeout: float = 60.0):
    """Connect to the job's store as a client; raise ``PermissionError`` when ``token`` is not the job's.

    ``timeout`` bounds the connection and is the default wait of every later ``get``/``wait`` on the store.
    """
    import torch.distributed as dist

    host, port = parse_endpoint(endpoint)
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except (RuntimeError, OSError) as e:
        raise ConnectionError(f"no dynatrain store answers at {endpoint} within {timeout:.0f}s: check the "
                              f"endpoint the launcher wrote, and that the store process still runs ({e})") from None
    check_token(store, endpoint, token, f"pass the token the job was started with (--token, or ${STORE_TOKEN_ENV})")
    return store


def check_token(store, endpoint: str, token: str, fix: str) -> None:
    """Raise ``PermissionError`` (saying ``fix``) unless ``token`` is the one the store at ``endpoint`` serves."""
    try:
        expected = store.get(TOKEN_KEY)
    except RuntimeError:
        raise ConnectionError(f"the store at {endpoint} holds no dynatrain token: it is not a dynatrain store "
                              f"(or it is still starting); check the endpoint") from None
    if not hmac.compare_digest(expected, _token_hash(token)):
        raise PermissionError(f"the store at {endpoint} refused the token: {fix}")


def serve_in_process(host: str, port: int, token: str, timeout: float):
    """Serve the job's store from this process (it lives as long as the returned object); raises ``RuntimeError``
    or ``OSError`` when the port is taken."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    store.set(TOKEN_KEY, _token_hash(token).decode())
    return store


def request_shutdown(store) -> None:
    """Ask the store process to exit; it does within about a poll interval."""
    store.set(SHUTDOWN_KEY, "1")


def serve(port: int, token: str, endpoint_file: Path | None, parent_pid: int | None, host: str = "0.0.0.0",
          poll: float = 0.2) -> None:
    """Serve the store until asked to stop or until ``parent_pid`` is gone."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    store.set(TOKEN_KEY, _token_hash(token).decode())
    # Clients connect to the host name they were given; 0.0.0.0 is only where the server listens.
    advertised = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    endpoint = f"{advertised}:{store.port}"
    if endpoint_file is not None:
        tmp = endpoint_file.with_name(endpoint_file.name + ".tmp")
        tmp.write_text(endpoint + "\n")
        tmp.replace(endpoint_file)  # readers never see a half-written endpoint
    print(endpoint, flush=True)
    while not store.check([SHUTDOWN_KEY]):
        if parent_pid is not None and not _alive(parent_pid):
            break
        time.sleep(poll)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A parent that died but was not yet reaped is a zombie: count it as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@dataclass
class StoreProcess:
    endpoint: str
    proc: subprocess.Popen

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                request_shutdown(connect_unchecked(self.endpoint, timeout=timeout))
                self.proc.wait(timeout=timeout)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=timeout)


def connect_unchecked(endpoint: str, timeout: float = 10.0):
    import torch.distributed as dist

    host, port = parse_endpoint(endpoint)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def start_store(token: str, workdir: Path, port: int = 0, host: str = "0.0.0.0", timeout: float = 60.0,
                log=None) -> StoreProcess:
    """Start the store process (it dies with this process) and return its endpoint once it serves."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    endpoint_file = workdir / f"store-endpoint-{os.getpid()}-{time.monotonic_ns()}"
    # Run the file, not ``-m dynatrain.elastic.store``: the package's __init__ imports Lightning, which the store
    # does not need and which would triple its start-up time.
    cmd = [sys.executable, str(Path(__file__).resolve()), "--port", str(port), "--host", host,
           "--endpoint-file", str(endpoint_file), "--parent-pid", str(os.getpid())]
    env = dict(os.environ, **{STORE_TOKEN_ENV: token})  # not on the command line, where `ps` would show it
    proc = subprocess.Popen(cmd, env=env, stdout=log or subprocess.DEVNULL, stderr=log or subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while not endpoint_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the store process exited with status {proc.returncode} before serving "
                               f"(port {port} taken? pass --port 0 for a free one)")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"the store process did not serve within {timeout:.0f}s")
        time.sleep(0.05)
    return StoreProcess(endpoint_file.read_text().strip(), proc)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="dynatrain's long-lived rendezvous store")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--token", default=None, help=f"job token (default: ${STORE_TOKEN_ENV})")
    p.add_argument("--endpoint-file", type=Path, default=None, help="write HOST:PORT here once serving")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process is gone (default: the process that started this one)")
    args = p.parse_args(argv)
    token = explicit_or_env(args.token, STORE_TOKEN_ENV)
    if not token:
        p.error(f"a token is required: pass --token or set ${STORE_TOKEN_ENV}")
    serve(args.port, token, args.endpoint_file, args.parent_pid or os.getppid(), host=args.host)


if __name__ == "__main__":
    main()
