"""The job's registry in its store: processes announce themselves with what they run; members read who may join.

A member or joiner is a stable process id (`dynatrain.elastic.world`); its registration holds its info (host,
model config hash, code version), checked against the job's when it registers.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

MATCH_FIELDS = ("model_config_hash", "code_version")


def canonical_json(obj: Any) -> str:
    """One text per value, on every process: keys sorted, no spaces."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


class RegistrationError(ValueError):
    pass


def config_hash(obj: Any) -> str:
    """A short stable hash of a JSON-able value: a model/training configuration for ``info["model_config_hash"]``,
    or a generation's member list for its keys in the store."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:16]


def register(store, member_id: str, info: dict, match: Iterable[str] = MATCH_FIELDS) -> None:
    """Record ``member_id`` as willing to join, after checking ``info`` against the job's.

    The first process to register (or :func:`set_job_info`) fixes the job's values of the ``match`` fields; a
    later process whose values differ is refused, since it would build a different model or run different code.
    """
    set_job_info(store, info, match)
    store.set(f"registry/info/{member_id}", canonical_json(info))
    # The id is published after its info, so a reader that sees the id also sees the info.
    n = store.add("registry/count", 1)
    store.set(f"registry/id/{n}", str(member_id))


def set_job_info(store, info: dict, match: Iterable[str] = MATCH_FIELDS) -> None:
    ref = {k: info.get(k) for k in match}
    job = json.loads(store.compare_set("registry/job", "", canonical_json(ref)).decode())
    diff = {k: (job.get(k), ref.get(k)) for k in set(job) | set(ref) if job.get(k) != ref.get(k)}
    if diff:
        lines = ", ".join(f"{k}: job has {a!r}, this process has {b!r}" for k, (a, b) in sorted(diff.items()))
        raise RegistrationError(f"registration refused, this process does not match the job ({lines}): start it "
                                f"with the job's model config and code version")


def deregister(store, member_id: str) -> None:
    store.set(f"registry/left/{member_id}", "1")


def registered(store) -> dict[str, dict]:
    """Every registered process that has not left, with its info."""
    out: dict[str, dict] = {}
    for i in range(1, store.add("registry/count", 0) + 1):
        if not store.check([f"registry/id/{i}"]):
            continue  # counted but not yet published: it shows up on the next call
        mid = store.get(f"registry/id/{i}").decode()
        if not store.check([f"registry/left/{mid}"]):
            out[mid] = json.loads(store.get(f"registry/info/{mid}").decode())
    return out


def processes_on_host(store, member_id: str, members: Iterable[str]) -> int:
    """How many of ``members`` registered the host ``member_id`` registered (itself included)."""
    infos = registered(store)
    host = infos.get(member_id, {}).get("host")
    return max(1, sum(1 for m in members if host is not None and infos.get(m, {}).get("host") == host))


def pending_joiners(store, members: Iterable[str]) -> dict[str, dict]:
    """Registered processes that are not in ``members``: candidates for the next generation."""
    current = set(members)
    return {m: info for m, info in registered(store).items() if m not in current}


def ready_key(member_id: str) -> str:
    """Set by a joiner once it is ready to be admitted."""
    return f"elastic/ready/{member_id}"


def ready_pending(store, members) -> list[str]:
    """The registered joiners outside ``members`` that said they are ready, sorted (their beats unchecked)."""
    return [m for m in sorted(pending_joiners(store, members)) if store.check([ready_key(m)])]
