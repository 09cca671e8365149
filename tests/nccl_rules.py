"""What NCCL would refuse, enforced on gloo: a wrapper over `torch.distributed` for the multi-process tests.

Every test process (the pytest process and, through `tests/nccl_site/sitecustomize.py`, every Python process a
test starts) runs its collectives through these rules:

1. **Metadata on the control group, and only there.** A collective issued by `dynatrain.runtime.control_group` must name a
   control group (a gloo group `dynatrain.runtime.control_group.new_control_group` made); a control group carries nothing else.
   On CUDA the training groups are NCCL, which refuses the CPU tensors metadata travels in.
2. **Device tensors on training groups.** Every tensor handed to a training group is on the device type named by
   ``$DYNATRAIN_NCCL_RULES_DEVICE`` (default: its backend's, cuda for NCCL and cpu for gloo, so CPU ranks on a CUDA
   host are held to gloo's); every tensor on a gloo group made for host traffic is on the CPU.
3. **A fresh group's first operation is a collective.** NCCL sets a communicator up at its first use and waits for
   every rank there; torch leaves a first ``batch_isend_irecv`` that not every rank joins undefined.
4. **Sends and receives between each pair are posted in matching order.** Each process appends its point-to-point
   operations to a log; `check_pairs` compares, per world and group, what one rank sent another with what that one
   received from it, in order, by size and dtype.

A breach raises `NcclRuleError` at the call (as NCCL would fail there) and is written to
``$DYNATRAIN_NCCL_RULES/violations-<pid>.txt``, so that one caught and survived still fails the test
(`tests/conftest.py` reads the directory after every test).
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import sys
import threading
import uuid
from pathlib import Path

ENV = "DYNATRAIN_NCCL_RULES"
DEVICE_ENV = "DYNATRAIN_NCCL_RULES_DEVICE"
_CONTROL_FILE = os.path.join("dynatrain", "runtime", "control_group.py")
_P2P = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}
_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
                "broadcast", "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor",
                "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "gather",
                "gather_object", "scatter", "scatter_object_list", "reduce"}


class NcclRuleError(RuntimeError):
    """A call NCCL would refuse or leave undefined."""


class _State(threading.local):
    depth = 0  # inside a wrapped call: torch's object collectives call its tensor ones


_local = _State()
_world = {"id": "", "fresh": set(), "host": set(), "control": set(), "installed": False}
# Calls checked, by the kind of group they went to: proof that a run was checked at all (`calls`).
_counts = {"control": 0, "host": 0, "training": 0, "p2p": 0}
_log_lock = threading.Lock()


def _out_dir() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def _device_type(dist, group) -> str | None:
    """The device type a training group takes: ``$DYNATRAIN_NCCL_RULES_DEVICE``, else its backend's (NCCL: cuda,
    gloo: cpu); None where one backend serves several (a ``cpu:gloo,cuda:nccl`` group) or none is known (fake)."""
    value = os.environ.get(DEVICE_ENV)
    if value:
        return value
    backend = str(dist.get_backend(group)).lower()
    return {"nccl": "cuda", "gloo": "cpu"}.get(backend)


def _append(name: str, line: str) -> None:
    out = _out_dir()
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    with _log_lock, open(out / f"{name}-{os.getpid()}.txt", "a") as f:
        f.write(line + "\n")


def _breach(message: str) -> None:
    _append("violations", message.replace("\n", " "))
    raise NcclRuleError(f"NCCL rule broken: {message}")


def _from_control() -> bool:
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_CONTROL_FILE):
            return True
        frame = frame.f_back
    return False


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _name(dist, group) -> str:
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    return group.group_name


def _check(dist, op: str, group, tensors: list, from_control: bool) -> None:
    name = _name(dist, group)
    if from_control and name not in _world["control"]:
        _breach(f"{op} from dynatrain.runtime.control_group on group {name!r}, a training group: metadata belongs on the "
                "control group (NCCL refuses its CPU tensors)")
    if not from_control and name in _world["control"]:
        _breach(f"{op} on the control group from outside dynatrain.runtime.control_group: training traffic belongs on the "
                "training groups")
    _counts["control" if name in _world["control"] else "host" if name in _world["host"] else "training"] += 1
    want = "cpu" if name in _world["host"] else _device_type(dist, group)
    for t in tensors:
        if want is not None and t.device.type != want:
            _breach(f"{op} on group {name!r} with a tensor on {t.device}: this group takes {want} tensors only")
    if name in _world["fresh"]:
        _world["fresh"].discard(name)
        if op in _P2P:
            _breach(f"{op} is the first operation on the fresh group {name!r}: a group's first operation must be "
                    "a collective every rank joins (form it eagerly, then barrier)")


def _log_p2p(dist, direction: str, tensor, peer: int, group) -> None:
    """``peer``: the other process's global rank."""
    if _out_dir() is None:
        return
    _counts["p2p"] += 1
    row = {"world": _world["id"], "group": _name(dist, group), "me": dist.get_rank(), "peer": int(peer),
           "dir": direction, "numel": tensor.numel(), "dtype": str(tensor.dtype)}
    _append("p2p", json.dumps(row))


def _wrap(dist, c10d, op: str):
    original = getattr(c10d, op)
    original_isend = getattr(c10d, "isend")
    signature = inspect.signature(original)

    @functools.wraps(original)
    def checked(*args, **kwargs):
        if _local.depth:
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        from_control = _from_control()
        if op == "batch_isend_irecv":
            ops = bound["p2p_op_list"]
            for p in ops:
                _check(dist, op, p.group, [p.tensor], from_control)
                _log_p2p(dist, "send" if p.op in (dist.isend, c10d.isend, original_isend) else "recv", p.tensor,
                         p.peer, p.group)
        else:
            group = bound.get("group")
            tensors = [t for key, v in bound.items() if key != "group" for t in _tensors(v)]
            _check(dist, op, group, tensors, from_control)
            if op in _P2P:
                peer = bound.get("dst", bound.get("src"))
                if peer is None:
                    group_peer = bound.get("group_dst", bound.get("group_src"))
                    peer = dist.get_global_rank(group or dist.distributed_c10d._get_default_group(), group_peer)
                _log_p2p(dist, "send" if op in ("send", "isend") else "recv", bound["tensor"], peer, group)
        _local.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            _local.depth -= 1

    return checked


def _wrap_new_group(dist, c10d):
    original = c10d.new_group

    @functools.wraps(original)
    def new_group(*args, **kwargs):
        from_control = _from_control()
        _local.depth += 1
        try:
            group = original(*args, **kwargs)
        finally:
            _local.depth -= 1
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
            return group
        backend = kwargs.get("backend") if "backend" in kwargs else (args[2] if len(args) > 2 else None)
        name = group.group_name
        _world["fresh"].add(name)
        if backend is not None and str(backend).lower() == "gloo":
            _world["host"].add(name)
        if from_control:
            _world["control"].add(name)
        return group

    return new_group


def _wrap_init(dist, c10d, original):
    """A new world: torch's ``init_process_group``, or dynatrain's `next_world.install` of a group formed apart."""

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        store = kwargs.get("store") or c10d._get_default_store()
        # One id per world, the same on every member (the first to ask sets it): the pair logs of one world only
        # are compared, as group names start again in each.
        try:
            world = store.compare_set("dynatrain-nccl-rules/world", "", uuid.uuid4().hex)
        except RuntimeError:  # a store without compare_set (torch's FakeStore): a world of this process alone
            world = uuid.uuid4().hex
        _world.update(id=world.decode() if isinstance(world, bytes) else str(world), fresh=set(), host=set(),
                      control=set())
        _world["fresh"].add(dist.distributed_c10d._get_default_group().group_name)
        from dynatrain.elastic import next_world

        control = next_world.formed_control_group()  # formed with the world, through its first collective there
        if control is not None:
            _world["control"].add(control.group_name)
            _world["host"].add(control.group_name)
        return result

    return init_process_group


def install() -> None:
    """Route this process's `torch.distributed` calls through the rules (idempotent)."""
    if _world["installed"]:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    _world["installed"] = True
    wrapped = {op: _wrap(dist, c10d, op) for op in sorted(_COLLECTIVES | _P2P) if hasattr(c10d, op)}
    wrapped["new_group"] = _wrap_new_group(dist, c10d)
    wrapped["init_process_group"] = _wrap_init(dist, c10d, c10d.init_process_group)
    for op, fn in wrapped.items():
        setattr(c10d, op, fn)
        if getattr(dist, op, None) is not None:
            setattr(dist, op, fn)
    from dynatrain.elastic import next_world

    next_world.install = _wrap_init(dist, c10d, next_world.install)
    atexit.register(_write_counts)


def _write_counts() -> None:
    if any(_counts.values()):
        _append("calls", json.dumps(_counts))


def installed() -> bool:
    return _world["installed"]


# ---- read back by the test process -------------------------------------------------------------------------
def offsets(out: Path) -> dict[str, int]:
    """How far each file in ``out`` is written now: what a test's processes add comes after (`new_lines`)."""
    return {p.name: p.stat().st_size for p in out.glob("*.txt")}


def new_lines(out: Path, kind: str, since: dict[str, int] | None = None) -> list[tuple[str, str]]:
    """(pid, line) of every ``kind`` file's lines written after ``since`` (all without it)."""
    rows = []
    for path in sorted(out.glob(f"{kind}-*.txt")):
        with open(path, "rb") as f:
            f.seek((since or {}).get(path.name, 0))
            text = f.read().decode(errors="replace")
        rows += [(path.stem.split("-", 1)[1], line) for line in text.splitlines()]
    return rows


def violations(out: Path, since: dict[str, int] | None = None) -> list[str]:
    return [f"pid {pid}: {line}" for pid, line in new_lines(out, "violations", since)]


def calls(out: Path) -> dict[str, int]:
    """The checked calls of every process that wrote into ``out`` and ended normally, summed by kind."""
    total = {k: 0 for k in _counts}
    for _, line in new_lines(out, "calls"):
        for k, v in json.loads(line).items():
            total[k] += v
    return total


def check_pairs(out: Path, since: dict[str, int] | None = None) -> list[str]:
    """Per world, group and ordered pair: the sends of one against the receives of the other, in order. A log cut
    short (a process killed on purpose) is compared up to where it ends."""
    sent: dict[tuple, list] = {}
    received: dict[tuple, list] = {}
    for _, line in new_lines(out, "p2p", since):
        try:
            r = json.loads(line)
        except ValueError:
            continue  # the last line of a process killed while writing it
        if r["dir"] == "send":
            sent.setdefault((r["world"], r["group"], r["me"], r["peer"]), []).append((r["numel"], r["dtype"]))
        else:
            received.setdefault((r["world"], r["group"], r["peer"], r["me"]), []).append((r["numel"], r["dtype"]))
    problems = []
    for key in sorted(set(sent) & set(received)):
        a, b = sent[key], received[key]
        n = min(len(a), len(b))
        for i in range(n):
            if a[i] != b[i]:
                world, group, src, dst = key
                problems.append(f"world {world[:8]} group {group!r}: rank {src}'s send #{i} to rank {dst} is "
                                f"{a[i]}, and rank {dst}'s receive #{i} from rank {src} is {b[i]}")
                break
    return problems

