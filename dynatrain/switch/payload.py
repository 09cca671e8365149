"""What a joining process receives over the job's store, as JSON (`JoinPayload`): the plan's inputs (the states of
the world change with their old and new placements), what the members kept besides the routed shards, the
checksums of the states before the switch, and the training loop's state at the switch boundary."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from dynatrain.switch.states import Kept
from dynatrain.vps.layout import StateSpec
from dynatrain.vps.placement import Replicate, Shard, Sharding, StridedShard


def _encode_sharding(sh: Sharding) -> list:
    kinds = [["R"] if isinstance(p, Replicate) else ["S", p.dim] if isinstance(p, Shard) else
             ["SS", p.dim, p.split_factor] for p in sh.placements]
    held = None if sh.held is None else [sh.held[0], list(sh.held[1])]
    return [list(sh.mesh_shape), kinds, [list(run) for run in sh.dims], held]


def _decode_sharding(row: list) -> Sharding:
    mesh, kinds, dims, held = row
    make = {"R": lambda: Replicate(), "S": lambda d: Shard(d), "SS": lambda d, f: StridedShard(d, f)}
    return Sharding(tuple(mesh), tuple(make[k[0]](*k[1:]) for k in kinds), tuple(tuple(r) for r in dims),
                    None if held is None else (held[0], tuple(held[1])))


def encode_specs(specs, old_shardings, new_shardings) -> list:
    """The states of a world change with their old and new placements, as JSON for a joiner."""
    return [[s.name, list(s.shape), s.dtype, _encode_sharding(a), _encode_sharding(b)]
            for s, a, b in zip(specs, old_shardings, new_shardings)]


def decode_specs(rows: list) -> tuple[tuple[StateSpec, ...], tuple[Sharding, ...], tuple[Sharding, ...]]:
    specs = tuple(StateSpec(n, tuple(shape), dtype) for n, shape, dtype, _, _ in rows)
    return (specs, tuple(_decode_sharding(r[3]) for r in rows), tuple(_decode_sharding(r[4]) for r in rows))


def encode_scalars(scalars: dict[str, dict]) -> dict:
    out = {}
    for name, entries in scalars.items():
        out[name] = {k: ({"tensor": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
                         if isinstance(v, torch.Tensor) else v) for k, v in entries.items()}
    return out


def decode_scalars(encoded: dict, device: torch.device) -> dict[str, dict]:
    out = {}
    for name, entries in encoded.items():
        out[name] = {k: (torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"]), device=device)
                         if isinstance(v, dict) and "tensor" in v else v) for k, v in entries.items()}
    return out


def encode_kept(kept: Kept) -> dict:
    return {"param_of": kept.param_of, "scalars": encode_scalars(kept.scalars), "order": kept.order,
            "groups": kept.groups}


def decode_kept(row: dict, device: torch.device) -> Kept:
    """A joiner's `Kept`; its schedulers come with the loop state, which Lightning restores."""
    return Kept(param_of={k: (v[0], v[1]) for k, v in row["param_of"].items()},
                scalars=decode_scalars(row["scalars"], device), order=row["order"], groups=row["groups"])


@dataclass(frozen=True)
class JoinPayload:
    """Rank 0's message to the processes a world change admits, written before the change is announced.

    ``intent``: the plan's inputs (`WorldPlan.intent`), from which a joiner derives the members' plan;
    ``target_ranks``: per new mesh position, its rank in the target world; ``union``: the member ids of the plan's
    processes; ``kept``: `encode_kept`; ``before``: the states' checksums before the switch (`check.verify`), or
    None unchecked; ``checkpoint``: the loop state; ``loggers``: the run's logger versions."""

    intent: dict
    target_ranks: list[int]
    union: list[str]
    kept: dict
    checkpoint: dict
    before: dict | None
    loggers: list

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "JoinPayload":
        return cls(**json.loads(text))
