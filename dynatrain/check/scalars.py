"""Scalars and objects hashed whole: the optimizer's ``step``, a parameter group's hyper-parameters, an LR
scheduler's ``state_dict()``, any JSON-like value. Each holder contributes one 64-bit hash of (name, canonical bytes
of the value); the bytes are the same for equal values on every rank, so holders that agree hash alike and the
reduced sums can tell how many hold the same value (`dynatrain.check.state_sums`)."""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping

import torch

from dynatrain.check.int64 import wrap64

_HEADS: dict = {}  # (dtype, shape) -> the bytes a tensor's begin with
_NUMPY = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
          torch.float64, torch.complex64, torch.complex128}


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
        if type(v) is not torch.Tensor:
            from torch.distributed.tensor import DTensor

            if isinstance(v, DTensor):  # its local part, with where that part lies
                out += b"D" + repr((tuple(v.shape), tuple(str(p) for p in v.placements))).encode()
                v = v.to_local()
        _tensor_bytes(v.detach().cpu(), out)
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


def _tensor_bytes(t: torch.Tensor, out: bytearray) -> None:
    """dtype, shape and raw bits of a CPU tensor (every parameter's ``step`` is one: a switch hashes them twice)."""
    key = (t.dtype, t.shape)
    head = _HEADS.get(key)
    if head is None:
        if len(_HEADS) >= 4096:
            _HEADS.clear()
        head = _HEADS[key] = (b"t" + repr((str(t.dtype), tuple(t.shape))).encode()
                              + str(t.numel() * t.element_size()).encode() + b":")
    out += head
    if t.dtype in _NUMPY:  # numpy's bytes of the array are its C-order bits, without torch's views
        out += t.numpy().tobytes()
    elif t.numel():
        out += t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


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
    return wrap64(int.from_bytes(d.digest(), "little") | 1)

