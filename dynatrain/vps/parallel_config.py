"""`ParallelConfig`: the shape of a layout, dp_replicate x dp_shard x tp, tp fastest-varying."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynatrain.models.configs import ModelConfig

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "tp")
_TERM = re.compile(r"^\s*(dp_replicate|dp_shard|tp)\s*=\s*(-?\d+)\s*$")


@dataclass(frozen=True, order=True)
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIM_NAMES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def parse(cls, text: "str | ParallelConfig") -> "ParallelConfig":
        """Parse ``"dp_replicate=R,dp_shard=S,tp=T"``; a missing term is 1."""
        if isinstance(text, ParallelConfig):
            return text
        if not isinstance(text, str) or not text.strip():
            raise ValueError(
                f"a layout is written like 'dp_replicate=2,dp_shard=2,tp=2' (missing terms are 1), got {text!r}"
            )
        values: dict[str, int] = {}
        for term in text.split(","):
            match = _TERM.match(term)
            if not match:
                raise ValueError(
                    f"cannot parse {term.strip()!r} in layout {text!r}: each term is dp_replicate=N, dp_shard=N or tp=N"
                )
            name, value = match.group(1), int(match.group(2))
            if name in values:
                raise ValueError(f"layout {text!r} gives {name} twice")
            values[name] = value
        return cls(**values)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many distinct micro-batches one step sees at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.tp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """Mesh coordinate (r, s, t) of a position in the default order: rank = (r*S + s)*T + t."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} for layout {self}")
        t = rank % self.tp
        s = (rank // self.tp) % self.dp_shard
        r = rank // (self.tp * self.dp_shard)
        return r, s, t

    def rank_of(self, r: int, s: int, t: int) -> int:
        return (r * self.dp_shard + s) * self.tp + t

    def validate(self, model: "ModelConfig | None" = None, world_size: int | None = None) -> "ParallelConfig":
        """Raise ValueError naming the constraint that fails; return self when it fits."""
        if world_size is not None and self.world_size != world_size:
            raise ValueError(
                f"layout {self} needs dp_replicate*dp_shard*tp = {self.world_size} devices, "
                f"but there are {world_size}: change the layout so the product is {world_size}"
            )
        if model is not None and self.tp > 1:
            for what, size in (
                ("n_heads", model.n_heads),
                ("n_kv_heads", model.n_kv_heads),
                ("ffn_dim", model.ffn_dim),
                ("vocab_size", model.vocab_size),
            ):
                if size % self.tp:
                    raise ValueError(
                        f"tp={self.tp} does not divide {what}={size} of model {model.name!r}: "
                        f"choose a tp that divides {size}"
                    )
        return self

    def __str__(self) -> str:
        return f"dp_replicate={self.dp_replicate},dp_shard={self.dp_shard},tp={self.tp}"

    def short(self) -> str:
        """Only the terms that are not 1 (``"dp_shard=2,tp=2"``); ``"dp_shard=1"`` for a single device."""
        terms = [f"{n}={getattr(self, n)}" for n in MESH_DIM_NAMES if getattr(self, n) != 1]
        return ",".join(terms) or "dp_shard=1"
