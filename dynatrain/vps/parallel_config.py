"""`ParallelConfig`: the shape of a layout, pp x dp_replicate x dp_shard x cp x tp, tp fastest-varying, and the
expert-parallel degree ``ep``, which borrows its ranks from ``dp_shard``.

With ``cp > 1`` (context parallelism) each sample's sequence is split over the ``cp`` ranks that sit between
``dp_shard`` and ``tp`` (torchtitan's order): they read the same samples, as tp peers do, and FSDP shards every
state over ``dp_shard x cp`` (the flattened ``dp_shard_cp``), so a state lies exactly as on ``dp_shard * cp``
without cp. Only the data split and the attention tell the two apart.

With ``pp > 1`` the root mesh has a leading ``pp`` dimension: each pipeline stage is one whole
``(dp_replicate, dp_shard, tp)`` sub-mesh, positions ``[k * stage_size, (k + 1) * stage_size)`` for stage ``k``, and
a state of a stage lives on that stage's sub-mesh only.

With ``ep > 1`` the root mesh splits ``dp_shard`` into ``(efsdp, ep)``: the ranks of one ep group are consecutive
dp_shard indices, routed experts are split over ``ep`` and sharded by FSDP over ``efsdp``, and everything else
shards over ``dp_shard`` (the flattened pair) as without ep. Positions keep the row-major order of the
``(dp_replicate, dp_shard, tp)`` view, so ep changes which states a position holds, never which position a
process takes.

With both, ep borrows its ranks from ``dp_shard x cp`` (torchtitan's way): an ep group is ``ep / cp`` consecutive
dp_shard indices with all their cp ranks, so the root mesh is ``(dp_replicate, efsdp, dp_shard_in_ep, cp, tp)`` and
``ep`` is the flattened ``(dp_shard_in_ep, cp)``; ``efsdp = dp_shard * cp / ep``. The cp ranks of one sample then
send their own tokens to the experts: routing is per token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol


class ModelShape(Protocol):
    """What a layout is checked against: the sizes it splits. Any model config with these fields serves (the zoo's
    `ModelConfig`, a Hugging Face model's read by `models.hf_shape`); ``n_layers``, ``n_experts`` and ``ffn_dim`` are
    read when present, so the space needs no model class."""

    name: str
    n_heads: int
    n_kv_heads: int
    vocab_size: int

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "tp")
EP_MESH_DIM_NAMES = ("dp_replicate", "efsdp", "ep", "tp")
CP_MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
EP_CP_MESH_DIM_NAMES = ("dp_replicate", "efsdp", "dp_shard_in_ep", "cp", "tp")
_TERMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
_TERM = re.compile(r"^\s*(pp|dp_replicate|dp_shard|cp|tp|ep)\s*=\s*(-?\d+)\s*$")


class LayoutError(ValueError, RuntimeError):
    """A layout that does not fit the devices or the model. A ValueError, as every bad request here, and the
    RuntimeError Lightning's ModelParallelStrategy raises for the same mistake, so code written for it catches it."""


@dataclass(frozen=True, order=True)
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1  # last, so positional construction (dp_replicate, dp_shard, tp, ep, pp) keeps its meaning

    def __post_init__(self) -> None:
        for name in _TERMS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.cp > 1 and self.ep > 1:
            if self.ep % self.cp or self.dp_shard % (self.ep // self.cp):
                raise ValueError(
                    f"ep={self.ep} with cp={self.cp} takes its ranks from dp_shard x cp, whole cp groups at a time (as "
                    f"torchtitan's): ep must be a multiple of cp={self.cp} and ep/cp must divide dp_shard="
                    f"{self.dp_shard}: choose ep among {self._eps_with_cp()}, or cp=1"
                )
        elif self.dp_shard % self.ep:
            raise ValueError(
                f"ep={self.ep} takes its ranks from dp_shard, but dp_shard={self.dp_shard} is not a multiple of it: "
                f"choose dp_shard a multiple of {self.ep} (e.g. dp_shard={self.ep * max(1, self.dp_shard // self.ep)}) "
                f"or an ep that divides {self.dp_shard}"
            )

    def _eps_with_cp(self) -> list[int]:
        return [self.cp * k for k in range(1, self.dp_shard + 1) if self.dp_shard % k == 0]

    @classmethod
    def parse(cls, text: "str | ParallelConfig") -> "ParallelConfig":
        """Parse ``"pp=P,dp_replicate=R,dp_shard=S,cp=C,tp=T,ep=E"``; a missing term is 1."""
        if isinstance(text, ParallelConfig):
            return text
        if not isinstance(text, str) or not text.strip():
            raise ValueError(
                f"a layout is written like 'pp=2,dp_replicate=2,dp_shard=2,tp=2' (missing terms are 1), got {text!r}"
            )
        values: dict[str, int] = {}
        for term in text.split(","):
            match = _TERM.match(term)
            if not match:
                raise ValueError(
                    f"cannot parse {term.strip()!r} in layout {text!r}: each term is pp=N, dp_replicate=N, dp_shard=N, "
                    "cp=N, tp=N or ep=N"
                )
            name, value = match.group(1), int(match.group(2))
            if name in values:
                raise ValueError(f"layout {text!r} gives {name} twice")
            values[name] = value
        return cls(**values)

    @property
    def world_size(self) -> int:
        return self.pp * self.stage_size

    @property
    def stage_size(self) -> int:
        """Positions of one pipeline stage: dp_replicate * dp_shard * cp * tp (the whole world without pp)."""
        return self.dp_replicate * self.fsdp_shard * self.tp

    @property
    def fsdp_shard(self) -> int:
        """The ranks FSDP shards a dense state over: dp_shard * cp (cp ranks hold shards as dp_shard ranks do)."""
        return self.dp_shard * self.cp

    def sequence_chunk(self, seq_len: int) -> int:
        """The tokens of one of a sequence's ``2 * cp`` load-balanced chunks; a LayoutError when they do not divide
        ``seq_len``."""
        if seq_len % (2 * self.cp):
            raise LayoutError(
                f"cp={self.cp} splits each sequence into 2*cp = {2 * self.cp} equal chunks (rank i holds chunks i and "
                f"{2 * self.cp - 1}-i, which balances causal attention), and the sequence length {seq_len} is not a "
                f"multiple of {2 * self.cp}: choose a sequence length that is, or a smaller cp"
            )
        return seq_len // (2 * self.cp)

    def stage_of(self, position: int) -> int:
        """The pipeline stage (pp coordinate) of a mesh position."""
        return position // self.stage_size

    def survivor_layouts(self, count: int) -> list["ParallelConfig"]:
        """What ``count`` processes left of this layout fall back to, in order, when no policy chooses: the same tp
        degree where it still divides ``count``, else pure FSDP."""
        out = [ParallelConfig(dp_shard=count // self.tp, tp=self.tp)] if count % self.tp == 0 else []
        return out + [ParallelConfig(dp_shard=count)]

    def dp_rank_of(self, position: int) -> int:
        """The data-parallel rank of a mesh position: every stage's positions of one dp index read one batch, the
        cp and tp ranks of it included."""
        return (position % self.stage_size) // (self.cp * self.tp)

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many distinct micro-batches one step sees at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The root mesh: ``(dp_replicate, dp_shard, tp)``, ``(dp_replicate, efsdp, ep, tp)`` with ep,
        ``(dp_replicate, dp_shard, cp, tp)`` with cp; with pp, a leading ``pp`` dimension."""
        if self.ep > 1 and self.cp > 1:
            shape = (self.dp_replicate, self.efsdp, self.ep // self.cp, self.cp, self.tp)
        elif self.ep > 1:
            shape = (self.dp_replicate, self.efsdp, self.ep, self.tp)
        elif self.cp > 1:
            shape = (self.dp_replicate, self.dp_shard, self.cp, self.tp)
        else:
            shape = (self.dp_replicate, self.dp_shard, self.tp)
        return ((self.pp,) if self.pp > 1 else ()) + shape

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        if self.ep > 1:
            names = EP_CP_MESH_DIM_NAMES if self.cp > 1 else EP_MESH_DIM_NAMES
        else:
            names = CP_MESH_DIM_NAMES if self.cp > 1 else MESH_DIM_NAMES
        return (("pp",) if self.pp > 1 else ()) + names

    @property
    def pp_dim(self) -> int | None:
        """The root mesh dimension of the pipeline stages (None without pp)."""
        return 0 if self.pp > 1 else None

    def without_pp(self) -> "ParallelConfig":
        """One stage's layout: the same data and tensor parallelism without pipeline stages."""
        return ParallelConfig(self.dp_replicate, self.dp_shard, self.tp, self.ep, cp=self.cp)

    @property
    def efsdp(self) -> int:
        """The ranks FSDP shards each routed expert over: dp_shard * cp / ep."""
        return self.fsdp_shard // self.ep

    def flattened_dims(self) -> dict[str, tuple[str, ...]]:
        """Names a mesh of this layout also answers to, each a flattening of root dimensions: ``dp_shard`` with ep,
        ``dp_shard_cp`` (what FSDP shards over) with cp, and Lightning's ``data_parallel`` and ``tensor_parallel``
        (so code written for ModelParallelStrategy runs). With cp, ``data_parallel`` spans cp too: code that
        shards over it then reduces gradients over the cp ranks, which see different tokens of one sample."""
        if self.ep > 1 and self.cp > 1:
            dp_shard = ("efsdp", "dp_shard_in_ep", "cp")
            out = {"dp_shard": dp_shard[:2], "ep": dp_shard[1:], "dp_shard_cp": dp_shard}
        else:
            dp_shard = ("efsdp", "ep") if self.ep > 1 else ("dp_shard", "cp") if self.cp > 1 else ("dp_shard",)
            out = {"dp_shard": dp_shard} if self.ep > 1 else {"dp_shard_cp": dp_shard} if self.cp > 1 else {}
        out["data_parallel"] = ("dp_replicate",) + dp_shard
        out["tensor_parallel"] = ("tp",)
        return out

    def root_dims(self, name: str) -> tuple[int, ...]:
        """The root mesh dimensions a named dimension spans (``dp_shard`` is ``(efsdp, ep)`` with ep; ``dp_shard_cp``,
        what FSDP shards over, is ``(dp_shard, cp)`` with cp and ``dp_shard`` without)."""
        names = self.mesh_dim_names
        if name in ("dp_shard", "ep") and self.ep > 1 and self.cp > 1:
            first = names.index("efsdp" if name == "dp_shard" else "dp_shard_in_ep")
            return (first, first + 1)
        if name == "dp_shard" and self.ep > 1:
            return (names.index("efsdp"), names.index("ep"))
        if name == "dp_shard_cp":
            return self.root_dims("dp_shard") + ((names.index("cp"),) if self.cp > 1 else ())
        if name not in names:
            raise ValueError(f"layout {self.short()} has no mesh dimension {name!r}; it has {', '.join(names)}")
        return (names.index(name),)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """Mesh coordinate (r, s, t) within its stage of a position in the default order:
        rank = ((p*R + r)*S + s)*T + t, where ``s`` runs over FSDP's ``dp_shard * cp`` ranks (s = dp_shard index * cp
        + cp index)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} for layout {self}")
        rank %= self.stage_size
        t = rank % self.tp
        s = (rank // self.tp) % self.fsdp_shard
        r = rank // (self.tp * self.fsdp_shard)
        return r, s, t

    def rank_of(self, r: int, s: int, t: int, p: int = 0) -> int:
        return ((p * self.dp_replicate + r) * self.fsdp_shard + s) * self.tp + t

    def validate(self, model: ModelShape | None = None, world_size: int | None = None) -> "ParallelConfig":
        """Raise ValueError naming the constraint that fails; return self when it fits."""
        if world_size is not None and self.world_size != world_size:
            raise LayoutError(
                f"layout {self} needs {'pp*' if self.pp > 1 else ''}dp_replicate*dp_shard*{'cp*' if self.cp > 1 else ''}"
                f"tp = {self.world_size} devices, "
                f"but there are {world_size}: change the layout so the product is {world_size}"
            )
        n_layers = getattr(model, "n_layers", None) if model is not None else None
        if n_layers is not None and self.pp > n_layers:
            raise LayoutError(
                f"pp={self.pp} needs at least one layer per stage, and model {model.name!r} has {n_layers}: choose "
                f"pp <= {n_layers}"
            )
        if model is not None and self.ep > 1:
            n_experts = getattr(model, "n_experts", None)
            if n_experts is None:
                raise LayoutError(
                    f"ep={self.ep} splits routed experts, and model {model.name!r} has none: use ep=1 "
                    "(or a mixture-of-experts model)"
                )
            if n_experts % self.ep:
                raise LayoutError(
                    f"ep={self.ep} does not divide n_experts={n_experts} of model {model.name!r}: choose an ep that "
                    f"divides {n_experts}"
                )
        if model is not None and self.tp > 1:
            sizes = [("n_heads", model.n_heads), ("n_kv_heads", model.n_kv_heads)]
            if getattr(model, "ffn_dim", None):
                sizes.append(("ffn_dim", model.ffn_dim))
            for what, size in sizes + [("vocab_size", model.vocab_size)]:
                if size % self.tp:
                    raise LayoutError(
                        f"tp={self.tp} does not divide {what}={size} of model {model.name!r}: "
                        f"choose a tp that divides {size}"
                    )
        return self

    @classmethod
    def from_lightning_sizes(cls, data_parallel_size: "int | str", tensor_parallel_size: "int | str",
                             num_nodes: int, devices_per_node: int) -> "ParallelConfig":
        """The layout Lightning's ``ModelParallelStrategy(data_parallel_size, tensor_parallel_size)`` runs:
        ``"auto"`` data parallelism is the number of nodes, ``"auto"`` tensor parallelism the devices of one node;
        data parallelism is FSDP over ``dp_shard``. LayoutError when the product is not the world size."""
        dp = num_nodes if data_parallel_size == "auto" else data_parallel_size
        tp = devices_per_node if tensor_parallel_size == "auto" else tensor_parallel_size
        for name, value in (("data_parallel_size", dp), ("tensor_parallel_size", tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive integer or 'auto', got {value!r}")
        world = num_nodes * devices_per_node
        if dp * tp != world:
            raise LayoutError(
                f"The sizes `data_parallel_size={dp}` and `tensor_parallel_size={tp}` multiplied should equal the "
                f"world size ({world}): choose sizes whose product is {world}"
            )
        return cls(dp_shard=dp, tp=tp)

    def __str__(self) -> str:
        cp = f",cp={self.cp}" if self.cp > 1 else ""
        text = f"dp_replicate={self.dp_replicate},dp_shard={self.dp_shard}{cp},tp={self.tp}"
        text = text if self.ep == 1 else f"{text},ep={self.ep}"
        return text if self.pp == 1 else f"pp={self.pp},{text}"

    def short(self) -> str:
        """Only the terms that are not 1 (``"dp_shard=2,tp=2"``); ``"dp_shard=1"`` for a single device."""
        terms = [f"{n}={getattr(self, n)}" for n in _TERMS if getattr(self, n) != 1]
        return ",".join(terms) or "dp_shard=1"
