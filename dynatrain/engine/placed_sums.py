"""Bitwise check of a switch that trusts nothing it verifies: each element is indexed by what its tensor says.

`verify` hashes every element with its global flat index, but takes that index (and the replication factor) from
the plan's `Layout`, the very map the engine wrote by: a placement error the layout and the engine share passes.
Here the index of a local element comes from the tensor itself: a DTensor's device mesh, placements and global
shape, through DTensor's own offset arithmetic (`compute_local_shape_and_global_offset`; per-dimension index lists
where a `_StridedShard` leaves them not contiguous); a plain tensor is whole, at offset 0. The replication factor
comes from the tensors too: the number of elements the ranks hold, summed, over the number the state has. Nothing
here imports the layout, the planner or the strategies.

Per state, every rank contributes (all int64, wrapping, so exact modulo 2**64):

- ``sum``: the sum over its elements of ``h = (bits + MIX) * (2 * index + 1); h ^= h >> 29`` (`verify`'s hash,
  bit for bit), or for a scalar or object the 64-bit hash of (name, canonical bytes of the value);
- ``held``: the elements it holds (a scalar: 1 holder);
- ``size``, ``knowers``: the state's element count, and 1, from every rank that has the state at all (a rank off
  a DTensor's mesh still knows its shape; one without it, another pipeline stage, does not);
- ``square``: a scalar's hash squared (0 for tensors): with ``k`` holders, ``sum**2 == k * square`` exactly when
  every holder hashed the same value (``sum**2 - k*square = -sum over pairs (h_i - h_j)**2``);
- ``bad``: 1 where the local tensor contradicts its own placements (its shape is not the one they give, a pending
  reduction, a dtype whose bits cannot be read).

`reduce` sums all of it over the ranks in one all-reduce; `differing` / `explain` compare the totals of before and
after: replication ``rep = held / size`` must be a positive integer (or nothing held of an empty state), the size
the same, the scalars' holders in agreement, and ``old_sum * new_rep == new_sum * old_rep`` modulo 2**64.

Cost, measured on this repository's CPU host (2 shared cores, load average 3 to 6 from other jobs): hashing is
the whole cost, the all-reduce carries 6 int64 per state. 0.85 to 0.9 s per GiB of float32 state (1.66 s/GiB of
bfloat16: the cost is per element, about 3.3 ns), on one thread and on two alike on that busy host; plus about
0.07 to 0.09 ms of fixed cost per state (1000 small DTensors: 0.09 s). A switch sums each rank's share twice (before
and after). For comparison `verify._box_checksum`, which materialises whole-tensor temporaries, took 8 s/GiB there.
On a GPU the same ops run in 4 Mi-element chunks with one host transfer per call of `local_sums` (not measured:
no GPU was lent). Measure with

    .venv/bin/python -m dynatrain.engine.placed_sums --gib 1 --threads 1     # add --dtype bfloat16, --threads 2

(it hashes a 2-d tensor of that size as `local_sums` does, three times, and prints the best s/GiB and the load).
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio constant as a signed int64 (as in `verify`)
_CHUNK = 24576  # elements hashed at once on a CPU: below torch's intra-op grain (32768), so every op runs serially
_CHUNK_ACCELERATOR = 1 << 22  # on a GPU: fewer kernel launches, 3 temporaries of 32 MiB (not measured here)
_FIELDS = ("sums", "held", "sizes", "knowers", "squares", "bad")


def _wrap(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


# ---------------------------------------------------------------------------------------------------------------
# Where a local tensor lies in its global tensor, by the tensor's own word.


Index = range | torch.Tensor  # the global indices along one dimension: a contiguous range, or any (int64, CPU)


def placed_indices(t: torch.Tensor, memo: dict | None = None) -> list[Index] | None:
    """Per dimension of the global tensor, the global indices of the local tensor's entries along it, from ``t``'s
    own metadata: a DTensor's mesh, placements and shape; a plain tensor whole. A contiguous run is a ``range``,
    anything else (a `_StridedShard` after another shard of its dimension) an int64 tensor. None: this rank is not
    on the DTensor's mesh and holds nothing. A 0-d tensor gives ``[]`` (one element, flat index 0).

    ``memo``: a dict kept for one pass (the meshes stay alive meanwhile), where tensors placed alike (a parameter
    and its optimizer moments) share one answer.

    ValueError: a pending reduction (`Partial`), whose local values are not elements of the tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return [range(n) for n in t.shape]
    mesh, placements, shape = t.device_mesh, tuple(t.placements), tuple(t.shape)
    if memo is None:
        return _placed(mesh, placements, shape)
    key = (id(mesh), placements, shape)
    if key not in memo:
        try:
            memo[key] = _placed(mesh, placements, shape)
        except ValueError as e:
            memo[key] = e
    if isinstance(memo[key], ValueError):
        raise memo[key]
    return memo[key]


def _placed(mesh, placements: tuple, shape: tuple[int, ...]) -> list[Index] | None:
    if mesh.get_coordinate() is None:
        return None
    if any(p.is_partial() for p in placements):
        raise ValueError(f"placements {placements} hold a pending reduction, not the tensor's elements")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    if not _strided(placements):  # Shard gives a contiguous range per dimension: the box is exact
        return [range(o, o + n) for o, n in zip(offset, local_shape)]
    exact = _strided_indices(shape, mesh, placements)
    sizes = tuple(len(ix) for ix in exact)
    firsts = tuple(int(ix[0]) if len(ix) else o for ix, o in zip(exact, offset))
    if sizes != tuple(local_shape) or firsts != tuple(offset):
        raise ValueError(f"torch's offsets of {placements} on {shape}: box {local_shape} at {offset}, indices "
                         f"{sizes} from {firsts}: its two views of one computation disagree")
    return [range(o, o + n) if torch.equal(ix, torch.arange(o, o + n)) else ix
            for ix, o, n in zip(exact, offset, local_shape)]


def _strided(placements) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, _StridedShard) for p in placements)


def _strided_indices(shape, mesh, placements) -> list[torch.Tensor]:
    """Per dimension, every global index (not only the first, which is all `compute_local_shape_and_global_offset`
    returns): a `_StridedShard` after another shard of the same dimension leaves the local entries apart. The same
    left-to-right walk as torch's `_compute_local_shape_and_global_offset`, through its own per-dimension step."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    coord = mesh.get_coordinate()
    index = [torch.arange(n, dtype=torch.int64) for n in shape]
    sharded: set[int] = set()
    for mesh_dim, p in enumerate(placements):
        if not (p.is_shard() or isinstance(p, _StridedShard)):
            continue
        d = p.dim
        size, offsets = _get_shard_size_and_offsets(
            len(index[d]), mesh.size(mesh_dim), coord[mesh_dim], p, index[d] if d in sharded else None, shape[d],
            False)
        index[d] = offsets[:size].to(torch.int64) if size else index[d][:0]
        sharded.add(d)
    return index


# ---------------------------------------------------------------------------------------------------------------
# The element hash (`verify._box_checksum`'s, generalised from a box to per-dimension index lists).


def indexed_checksum(local: torch.Tensor, indices: Sequence[Index], shape: Sequence[int]) -> int:
    """Sum over the elements of ``local`` of the hash of (bits, global flat index in ``shape``), where entry
    ``(i0, i1, ...)`` of ``local`` is element ``(indices[0][i0], indices[1][i1], ...)``. Equal to
    `verify._box_checksum` for a box (``indices`` = ranges). Vectorised in chunks: on a CPU, chunks smaller than
    torch's intra-op grain, spread over ``torch.get_num_threads()`` Python threads (torch releases the GIL in an
    op), so no op waits at an OpenMP barrier: on an oversubscribed host those cost a time slice each (measured 25
    to 90 s/GiB with 2 OpenMP threads at load 12 on 2 cores, against 1.7 s/GiB this way). Besides the chunks'
    temporaries it allocates one index per row (all dimensions but the last), never one per element."""
    return _wrap(int(_checksum(local, indices, shape).item()))


def _checksum(local: torch.Tensor, indices: Sequence[Index], shape: Sequence[int]) -> torch.Tensor:
    """`indexed_checksum` as a 0-d int64 tensor on ``local``'s device (no host synchronisation but on a CPU)."""
    dev = local.device
    if local.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=dev)
    bits = local.detach().contiguous().view(_BITS[local.element_size()])
    shape, indices = tuple(shape), list(indices)
    if not shape:  # a 0-d tensor: one element at index 0
        bits, indices, shape = bits.reshape(1), [range(1)], (1,)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # The odd factor 2*index + 1 = outer2[row] + inner2[col], with rows over all dimensions but the last.
    outer2 = torch.zeros(1, dtype=torch.int64, device=dev)
    for d in range(len(shape) - 1):
        outer2 = (outer2[:, None] + _as_tensor(indices[d], dev)[None, :] * (2 * strides[d])).reshape(-1)
    last = indices[-1]
    rows, cols = outer2.numel(), len(last)
    bits = bits.reshape(rows, cols)
    cpu = dev.type == "cpu"
    chunk = _CHUNK if cpu else _CHUNK_ACCELERATOR
    step_r, step_c = max(1, chunk // cols), min(cols, chunk)
    if isinstance(last, range) and last.step == 1:
        inner2, start = torch.arange(step_c, dtype=torch.int64, device=dev) * 2 + 1, last.start
    else:
        inner2, start = _as_tensor(last, dev) * 2 + 1, None
    if rows * cols <= chunk:  # a small tensor (most of a model's states): the same ops, without the loop
        k = outer2[:, None] + (inner2[None, :cols] + 2 * start if start is not None else inner2[None, :])
        h = bits.to(torch.int64, copy=True)  # a copy even of int64 bits: the ops below write in place
        h.add_(_MIX).mul_(k)
        return h.bitwise_xor_(h >> 29).sum()
    n_c = -(-cols // step_c)
    tasks = -(-rows // step_r) * n_c

    def run(lo: int, hi: int) -> torch.Tensor:
        n = min(chunk, rows * cols)
        h, k, s = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(3))
        acc = torch.zeros((), dtype=torch.int64, device=dev)
        for task in range(lo, hi):
            r0, c0 = (task // n_c) * step_r, (task % n_c) * step_c
            r1, c1 = min(rows, r0 + step_r), min(cols, c0 + step_c)
            m = (r1 - r0) * (c1 - c0)
            hv, kv = h[:m].view(r1 - r0, c1 - c0), k[:m].view(r1 - r0, c1 - c0)
            if start is None:
                torch.add(outer2[r0:r1, None], inner2[None, c0:c1], out=kv)
            else:
                torch.add((outer2[r0:r1] + 2 * (start + c0))[:, None], inner2[None, :c1 - c0], out=kv)
            hv.copy_(bits[r0:r1, c0:c1])  # sign-extends, as `.to(torch.int64)` does
            hv.add_(_MIX).mul_(kv)
            torch.bitwise_right_shift(h[:m], 29, out=s[:m])
            h[:m].bitwise_xor_(s[:m])
            acc += h[:m].sum()
        return acc

    workers = min(torch.get_num_threads(), tasks // 4) if cpu else 1
    if workers <= 1:
        return run(0, tasks)
    from concurrent.futures import ThreadPoolExecutor

    bounds = [tasks * w // workers for w in range(workers + 1)]
    with ThreadPoolExecutor(workers, thread_name_prefix="placed-sums") as pool:
        return torch.stack(list(pool.map(run, bounds[:-1], bounds[1:]))).sum()


def _as_tensor(ix: Index, device) -> torch.Tensor:
    if isinstance(ix, range):
        return torch.arange(ix.start, ix.stop, ix.step, dtype=torch.int64, device=device)
    return ix.to(device=device, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# Scalars and objects.


def _canonical(v, out: bytearray, depth: int = 0) -> None:
    """Type-tagged bytes of ``v``, the same for equal values on every rank: dict keys sorted by their bytes, lists
    and tuples alike, tensors as dtype, shape and raw bits, floats by their bits."""
    if depth > 64:
        raise ValueError("an object nested deeper than 64 levels")
    if v is None or isinstance(v, bool):
        out += b"N" if v is None else (b"T" if v else b"F")
    elif isinstance(v, int):
        out += b"i" + str(v).encode() + b";"
    elif isinstance(v, float):
        out += b"f" + struct.pack("<d", v)
    elif isinstance(v, complex):
        out += b"c" + struct.pack("<dd", v.real, v.imag)
    elif isinstance(v, str):
        b = v.encode("utf-8", "surrogatepass")
        out += b"s" + str(len(b)).encode() + b":" + b
    elif isinstance(v, (bytes, bytearray)):
        out += b"b" + str(len(v)).encode() + b":" + bytes(v)
    elif isinstance(v, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(v, DTensor):  # its local part, with where that part lies
            out += b"D" + repr((tuple(v.shape), tuple(str(p) for p in v.placements))).encode()
            v = v.to_local()
        t = v.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        out += b"t" + repr((str(t.dtype), tuple(t.shape))).encode() + str(raw.numel()).encode() + b":"
        out += raw.numpy().tobytes()
    elif isinstance(v, Mapping):
        items = []
        for key, value in v.items():
            kb, vb = bytearray(), bytearray()
            _canonical(key, kb, depth + 1)
            _canonical(value, vb, depth + 1)
            items.append((bytes(kb), bytes(vb)))
        out += b"{" + str(len(items)).encode() + b":"
        for kb, vb in sorted(items):
            out += kb + vb
        out += b"}"
    elif isinstance(v, (list, tuple)):
        out += b"[" + str(len(v)).encode() + b":"
        for x in v:
            _canonical(x, out, depth + 1)
        out += b"]"
    elif isinstance(v, (set, frozenset)):
        parts = []
        for x in v:
            b = bytearray()
            _canonical(x, b, depth + 1)
            parts.append(bytes(b))
        out += b"<" + str(len(parts)).encode() + b":" + b"".join(sorted(parts)) + b">"
    elif type(v).__module__ == "numpy":
        import numpy as np

        a = np.ascontiguousarray(np.asarray(v))
        out += b"n" + repr((a.dtype.str, a.shape)).encode() + b":" + a.tobytes()
    else:  # an object of the user's: its type and repr, memory addresses left out
        text = re.sub(r"0x[0-9a-fA-F]+", "0x", repr(v))
        out += b"o" + f"{type(v).__module__}.{type(v).__qualname__}".encode() + b"|" + text.encode() + b";"


def canonical_bytes(v) -> bytes:
    """The bytes a scalar or object is hashed by (see `_canonical`)."""
    out = bytearray()
    _canonical(v, out)
    return bytes(out)


def scalar_hash(name: str, value) -> int:
    """The 64-bit hash (a signed int64, odd) one holder of scalar state ``name`` contributes."""
    d = hashlib.blake2b(digest_size=8, person=b"dynatrain-sums")
    d.update(name.encode())
    d.update(b"\0")
    d.update(canonical_bytes(value))
    return _wrap(int.from_bytes(d.digest(), "little") | 1)


# ---------------------------------------------------------------------------------------------------------------
# Per-state sums: local, reduced, compared.


@dataclass
class StateSums:
    """Per state of ``names`` (one agreed order on every rank): this rank's contributions, or after `reduce` the
    totals over the ranks. ``problems``: why this rank marked a state bad (this rank's own, not reduced)."""

    names: tuple[str, ...]
    sums: list[int]
    held: list[int]  # elements held (a scalar: holders)
    sizes: list[int]  # sum of the state's element count over the ranks that have it (a scalar: 1 each)
    knowers: list[int]  # ranks that have it
    squares: list[int]  # a scalar: its hash squared; a tensor: 0
    bad: list[int]  # ranks whose local tensor contradicts its placements
    problems: dict[str, str] = field(default_factory=dict)

    @classmethod
    def empty(cls, names: Sequence[str]) -> StateSums:
        n = len(names)
        return cls(tuple(names), *([0] * n for _ in _FIELDS))

    def vector(self) -> list[int]:
        return [_wrap(x) for f in _FIELDS for x in getattr(self, f)]

    @classmethod
    def from_vector(cls, names: tuple[str, ...], values: Sequence[int], problems=None) -> StateSums:
        n = len(names)
        parts = [list(values[i * n:(i + 1) * n]) for i in range(len(_FIELDS))]
        return cls(names, *parts, problems=dict(problems or {}))


def local_sums(tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, object], names: Sequence[str]) -> StateSums:
    """This rank's contributions to every state of ``names``: a tensor (DTensor or plain) of ``tensors`` by the
    elements it holds where its own metadata places them, a value of ``scalars`` (a 0-d tensor, a number, a
    scheduler's ``state_dict()``, any JSON-like object) by one holder's hash; 0 for a name this rank has not.
    A local tensor that contradicts its placements is counted ``bad`` (reported by `explain` on every rank, after
    `reduce`) rather than raised, so no rank leaves the others waiting in the all-reduce."""
    both = set(tensors) & set(scalars)
    if both:
        raise ValueError(f"states given both as tensors and as scalars: {sorted(both)[:5]}")
    out = StateSums.empty(names)
    memo: dict = {}
    pending: list[tuple[int, torch.Tensor]] = []  # (state, its sum on the device): one transfer for all at the end
    for i, name in enumerate(out.names):
        if name in scalars:
            h = scalar_hash(name, scalars[name])
            out.sums[i], out.held[i], out.sizes[i], out.knowers[i], out.squares[i] = h, 1, 1, 1, _wrap(h * h)
            continue
        t = tensors.get(name)
        if t is None:
            continue
        out.sizes[i], out.knowers[i] = t.numel(), 1
        try:
            indices = placed_indices(t, memo)
            if indices is None:  # off the DTensor's mesh: holds nothing
                continue
            local = _local(t)
            want = tuple(len(ix) for ix in indices)
            if tuple(local.shape) != want:
                raise ValueError(f"local shape {tuple(local.shape)}, its placements give {want}")
            if local.element_size() not in _BITS:
                raise ValueError(f"dtype {local.dtype}: no integer view of its bits")
            pending.append((i, _checksum(local, indices, tuple(t.shape))))
            out.held[i] = local.numel()
        except ValueError as e:
            out.bad[i] = 1
            out.problems[name] = str(e)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, x in pending:
        by_device.setdefault(x.device, []).append((i, x))
    for items in by_device.values():
        for (i, _), value in zip(items, torch.stack([x for _, x in items]).tolist()):
            out.sums[i] = _wrap(value)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def reduce(sums: StateSums, device: torch.device | str = "cpu", group=None) -> StateSums:
    """``sums`` summed over the ranks of ``group`` (one all-reduce of one int64 tensor, ``6 * len(names)``);
    as it is without an initialised process group."""
    t = torch.tensor(sums.vector(), dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return StateSums.from_vector(sums.names, t.tolist(), sums.problems)


def reduce_pair(old: StateSums, new: StateSums, device: torch.device | str = "cpu",
                group=None) -> tuple[StateSums, StateSums]:
    """`reduce` of both sides in one all-reduce (the switch can keep its local sums of before until after)."""
    t = torch.tensor(old.vector() + new.vector(), dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    v, n = t.tolist(), len(_FIELDS) * len(old.names)
    return StateSums.from_vector(old.names, v[:n], old.problems), StateSums.from_vector(new.names, v[n:],
                                                                                       new.problems)


def _side(s: StateSums, i: int) -> tuple[int, int, str | None]:
    """(element count, replication, what is wrong or None) of state ``i`` of a reduced side."""
    held, size, knowers, square, bad = s.held[i], s.sizes[i], s.knowers[i], s.squares[i], s.bad[i]
    if bad:
        why = s.problems.get(s.names[i])
        return 0, 0, f"{bad} rank(s) hold a local tensor that contradicts its own placements" + (
            f" (here: {why})" if why else "")
    if size < 0 or size % knowers:
        return 0, 0, f"the ranks that have it disagree on its size ({size} over {knowers})"
    numel = size // knowers
    if numel == 0:
        return 0, 1, None if held == 0 else f"{held} elements held of an empty state"
    if held <= 0 or held % numel:
        return numel, 0, f"{held} elements held of {numel}: not a whole number of copies"
    if square and _wrap(s.sums[i] * s.sums[i] - held * square):
        return numel, 0, f"its {held} holders do not all hold the same value"
    return numel, held // numel, None


def explain(old: StateSums, new: StateSums) -> dict[str, str]:
    """Per state that differs between the reduced sums of before (``old``) and after (``new``), why; empty when
    every state is the same bit for bit (up to the hash) and consistently held on both sides."""
    if old.names != new.names:
        raise ValueError("old and new sums are over different state names: take both over one agreed list")
    out: dict[str, str] = {}
    for i, name in enumerate(old.names):
        known = old.knowers[i] > 0, new.knowers[i] > 0
        if known != (True, True):
            if known != (False, False):
                out[name] = "held by nobody " + ("before" if known[1] else "after") + " the switch"
            continue
        (a, p, why_a), (b, q, why_b) = _side(old, i), _side(new, i)
        if why_a or why_b:
            out[name] = "; ".join(f"{when}: {why}" for when, why in (("before", why_a), ("after", why_b)) if why)
        elif a != b:
            out[name] = f"{a} elements before, {b} after"
        elif _wrap(old.sums[i] * q) != _wrap(new.sums[i] * p):
            out[name] = "values differ"
    return out


def differing(old: StateSums, new: StateSums) -> list[str]:
    """Names of the states `explain` reports, in ``names`` order."""
    return list(explain(old, new))


def compare(old: StateSums, new: StateSums, device: torch.device | str = "cpu", group=None) -> dict[str, str]:
    """Local sums of before and after, reduced in one all-reduce and explained (empty: bitwise equal)."""
    return explain(*reduce_pair(old, new, device, group))


# ---------------------------------------------------------------------------------------------------------------
# What a live module and optimizer hold, named as the switch's capture names it.

PARAM_GROUP = "#param_group"
SCHEDULER = "#scheduler"


def module_state_tensors(module: torch.nn.Module, optimizer=None, schedulers: Sequence = (),
                         param_groups: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """(tensors, scalars) of ``module`` and ``optimizer`` as the switch's capture names them: each parameter by
    its name, each optimizer tensor of a parameter (not 0-d) as ``<param>.<key>``, each buffer by its name (the
    tensors themselves, DTensors not made local); every other optimizer entry (``step``, numbers, None) as a
    scalar ``<param>.<key>``. With ``param_groups``, each optimizer group's hyper-parameters as the scalar
    ``#param_group.<i>`` (its parameters by name); each of ``schedulers`` (torch LR schedulers) as
    ``#scheduler.<i>``, its ``state_dict()``."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, object] = {}
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names[id(p)] = name
        tensors[name] = p.detach()
        state = optimizer.state.get(p) if optimizer is not None else None
        for key, v in (state or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                tensors[f"{name}.{key}"] = v.detach()
            else:
                scalars[f"{name}.{key}"] = v
    for name, b in module.named_buffers():
        tensors[name] = b.detach()
    if optimizer is not None and param_groups:
        for i, g in enumerate(optimizer.param_groups):
            scalars[f"{PARAM_GROUP}.{i}"] = {
                k: [names.get(id(p), "?") for p in v] if k == "params" else v for k, v in g.items()}
    for i, s in enumerate(schedulers):
        scalars[f"{SCHEDULER}.{i}"] = s.state_dict()
    return tensors, scalars


def all_names(tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, object], group=None) -> tuple[str, ...]:
    """The sorted union of every rank's state names (one ``all_gather_object``): the agreed order where ranks
    have different states (pipeline stages)."""
    mine = sorted({*tensors, *scalars})
    if not (dist.is_available() and dist.is_initialized()):
        return tuple(mine)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return tuple(sorted({n for names in every for n in names}))


def _measure(gib: float, threads: int, dtype: str, repeats: int) -> list[float]:
    """Seconds per GiB that `indexed_checksum` takes on a 2-d tensor of ``gib`` GiB, per repetition (`__main__`)."""
    import time

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    elem = torch.tensor([], dtype=dt).element_size()
    cols = 4096
    rows = max(1, int(gib * (1 << 30)) // (elem * cols))
    t = torch.randn(rows, cols).to(dt)
    idx = [range(rows), range(cols)]
    indexed_checksum(t[:8], [range(8), idx[1]], (rows, cols))  # warm up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        indexed_checksum(t, idx, (rows, cols))
        out.append((time.perf_counter() - start) / (t.numel() * elem / (1 << 30)))
    return out


if __name__ == "__main__":
    import argparse
    import os

    ap = argparse.ArgumentParser(description="seconds per GiB the placed checksum takes on this machine")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs = _measure(args.gib, args.threads, args.dtype, args.repeats)
    print(f"{min(runs):.2f} s/GiB best of {len(runs)} ({', '.join(f'{r:.2f}' for r in runs)}; {args.dtype}, "
          f"{args.threads} thread(s), {math.ceil(args.gib * 1024)} MiB, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs)")
