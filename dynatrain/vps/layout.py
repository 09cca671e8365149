"""`Layout`: for every training state, which boxes every process holds.

States that split the same way (same shape and rule: every layer's ``wq``, and each parameter's Adam
moments) share one *class*, whose boxes are computed once per mesh position. Routing and assignment work
per class, which is what lets a 1,024-rank plan of an 80-layer model run in a second.

Processes are named by id. ``rank_map[position]`` is the process at a mesh position (``None`` for a vacant
position whose process was lost); a process without a position holds nothing (a joiner before the switch,
a leaver after it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from dynatrain.vps.box import Box
from dynatrain.vps.class_shards import ClassShards
from dynatrain.vps.parallel_config import ParallelConfig
from dynatrain.vps.placement import Sharding, sharding_shards
from dynatrain.vps.rules import LocalShards, ShardRule, layout_shards

DTYPE_ITEMSIZE = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
}

# Optimizer states per parameter: suffix and dtype. The bare name is the model weight.
STATE_KINDS: dict[str, tuple[tuple[str, str], ...]] = {
    "fp32-adam": (("", "float32"), (".exp_avg", "float32"), (".exp_avg_sq", "float32")),
    "bf16-adam": (("", "bfloat16"), (".master", "float32"), (".exp_avg", "float32"), (".exp_avg_sq", "float32")),
    "fp32": (("", "float32"),),
}


@dataclass(frozen=True)
class StateSpec:
    """One routed tensor: a parameter or one of its optimizer states."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    tp_dim: int | None = None
    fused: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"state {self.name!r}: unknown dtype {self.dtype!r}; use one of {', '.join(DTYPE_ITEMSIZE)}")
        self.rule  # validates shape / tp_dim / fused with a clear message

    @property
    def rule(self) -> ShardRule:
        return ShardRule(self.shape, self.tp_dim, self.fused)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, eq=False)
class ClassBoxes:
    """All boxes of one class as arrays: box ``b`` is ``[lo[b], hi[b])`` held by ``position[b]`` as its shard
    ``shard[b]``. Boxes are ordered by position, then shard."""

    lo: np.ndarray
    hi: np.ndarray
    position: np.ndarray
    shard: np.ndarray


@dataclass(frozen=True)
class Layout:
    """States, their classes, each class's shards per mesh position, and the process at each position."""

    states: tuple[StateSpec, ...]
    state_class: tuple[int, ...]
    classes: tuple[tuple[LocalShards, ...], ...]
    rank_map: tuple[int | None, ...]
    config: ParallelConfig | None = None
    shardings: tuple[Sharding, ...] | None = None  # per state, when the boxes came from placements
    _index: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.state_class) != len(self.states):
            raise ValueError("state_class needs one class index per state")
        n = len(self.rank_map)
        for c, shards in enumerate(self.classes):
            if len(shards) != n:
                raise ValueError(f"class {c} describes {len(shards)} positions, the rank map {n}")
        procs = [p for p in self.rank_map if p is not None]
        if any(not isinstance(p, (int, np.integer)) or p < 0 for p in procs):
            raise ValueError(f"process ids must be non-negative integers, got rank map {list(self.rank_map)}")
        if len(set(procs)) != len(procs):
            raise ValueError(f"a process appears at two positions of rank map {list(self.rank_map)}")
        names = [s.name for s in self.states]
        if len(set(names)) != len(names):
            raise ValueError("two states share a name")
        object.__setattr__(self, "rank_map", tuple(None if p is None else int(p) for p in self.rank_map))
        object.__setattr__(self, "_index", {s.name: i for i, s in enumerate(self.states)})

    # ----- construction
    @classmethod
    def from_config(
        cls, states: Iterable[StateSpec], pcfg: ParallelConfig, rank_map: Sequence[int | None] | None = None
    ) -> "Layout":
        """The layout `apply_tp` + `apply_fsdp` produce for ``pcfg``; ``rank_map`` defaults to position = process."""
        states = tuple(states)
        if pcfg.pp > 1:
            raise ValueError(f"layout {pcfg.short()} has pipeline stages, and the rules do not say which stage holds "
                             "which state: build it with models.specs.layout_for_model or Layout.from_shardings")
        if rank_map is None:
            rank_map = tuple(range(pcfg.world_size))
        if len(rank_map) != pcfg.world_size:
            raise ValueError(f"layout {pcfg.short()} has {pcfg.world_size} positions, the rank map {len(rank_map)}")
        keys: dict[ShardRule, int] = {}
        state_class = []
        for s in states:
            state_class.append(keys.setdefault(s.rule, len(keys)))
        classes = tuple(layout_shards(rule, pcfg) for rule in keys)
        return cls(states, tuple(state_class), classes, tuple(rank_map), pcfg)

    @classmethod
    def from_shardings(
        cls, states: Iterable[StateSpec], shardings: Sequence[Sharding], config: ParallelConfig,
        rank_map: Sequence[int | None] | None = None,
    ) -> "Layout":
        """The layout of states whose placements were read from DTensors (``shardings[i]`` for ``states[i]``), on
        the root mesh of ``config``; ``rank_map`` defaults to position = process."""
        states, shardings = tuple(states), tuple(shardings)
        if len(states) != len(shardings):
            raise ValueError(f"{len(states)} states need as many shardings, got {len(shardings)}")
        mesh = config.mesh_shape
        for s, sh in zip(states, shardings):
            if sh.mesh_shape != mesh:
                raise ValueError(f"state {s.name!r} lies on a mesh of shape {sh.mesh_shape}, the layout's is {mesh}")
            sh.order(len(s.shape))  # a sharding that cannot be described fails here, naming the state's placements
        if rank_map is None:
            rank_map = tuple(range(config.world_size))
        keys: dict[tuple, int] = {}
        state_class = [keys.setdefault((s.shape, sh), len(keys)) for s, sh in zip(states, shardings)]
        classes = tuple(sharding_shards(shape, sh) for shape, sh in keys)
        return cls(states, tuple(state_class), classes, tuple(rank_map), config, shardings)

    def with_rank_map(self, rank_map: Sequence[int | None]) -> "Layout":
        """The same boxes at the same positions, taken by other processes."""
        if len(rank_map) != len(self.rank_map):
            raise ValueError(f"rank map needs {len(self.rank_map)} positions, got {len(rank_map)}")
        return Layout(self.states, self.state_class, self.classes, tuple(rank_map), self.config, self.shardings)

    def without(self, processes: Iterable[int]) -> "Layout":
        """This layout with ``processes`` lost: their positions become vacant and their data unreadable."""
        gone = set(int(p) for p in processes)
        unknown = sorted(gone - set(self.processes))
        if unknown:
            raise ValueError(f"processes {unknown} hold no position in this layout; they cannot be lost")
        return self.with_rank_map([None if p in gone else p for p in self.rank_map])

    # ----- queries
    @property
    def world_size(self) -> int:
        """Mesh positions, vacant ones included."""
        return len(self.rank_map)

    @cached_property
    def processes(self) -> tuple[int, ...]:
        """Processes that hold a position, ascending."""
        return tuple(sorted(p for p in self.rank_map if p is not None))

    @cached_property
    def _positions(self) -> dict[int, int]:
        return {p: q for q, p in enumerate(self.rank_map) if p is not None}

    def position_of(self, process: int) -> int | None:
        return self._positions.get(process)

    def state(self, name: str) -> StateSpec:
        return self.states[self.state_index(name)]

    def state_index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ValueError(f"no state named {name!r} in this layout") from None

    def shards(self, state: str, process: int) -> LocalShards | None:
        """What ``process`` holds of ``state``; None when it holds no position."""
        q = self.position_of(process)
        if q is None:
            return None
        return self.classes[self.state_class[self.state_index(state)]][q]

    def boxes(self, state: str, process: int) -> tuple[Box, ...]:
        held = self.shards(state, process)
        return () if held is None else held.boxes

    @property
    def total_bytes(self) -> int:
        """Bytes of all states counted once (replicas not repeated)."""
        return sum(s.nbytes for s in self.states)

    @cached_property
    def class_bytes_per_element(self) -> tuple[int, ...]:
        """Per class, the bytes one element position costs summed over the class's states."""
        out = [0] * len(self.classes)
        for s, c in zip(self.states, self.state_class):
            out[c] += s.itemsize
        return tuple(out)

    def held_bytes(self, process: int) -> int:
        q = self.position_of(process)
        if q is None:
            return 0
        return sum(self.classes[c][q].numel * b for c, b in enumerate(self.class_bytes_per_element))

    @cached_property
    def needed_bytes(self) -> int:
        """Bytes all positions together hold (replicas counted every time): what a switch must deliver."""
        return sum(int(np.prod(boxes.hi - boxes.lo, axis=1).sum()) * b
                   for boxes, b in zip(self._class_boxes, self.class_bytes_per_element))

    def class_boxes(self, c: int) -> ClassBoxes:
        return self._class_boxes[c]

    def class_arrays(self, c: int) -> ClassShards:
        """Class ``c``'s shards as arrays, offsets and local shapes included (converted once if held as objects)."""
        return self._class_arrays[c]

    @cached_property
    def _class_arrays(self) -> tuple[ClassShards, ...]:
        return tuple(ClassShards.of(shards) for shards in self.classes)

    @cached_property
    def _class_boxes(self) -> tuple[ClassBoxes, ...]:
        out = []
        for shards in self.classes:
            if isinstance(shards, ClassShards):
                out.append(ClassBoxes(shards.lo, shards.hi, shards.position, shards.shard))
                continue
            ndim = len(shards[0].local_shape) if shards else 1
            lo, hi, pos, idx = [], [], [], []
            for q, held in enumerate(shards):
                for i, b in enumerate(held.boxes):
                    lo.append(b.lo)
                    hi.append(b.hi)
                    pos.append(q)
                    idx.append(i)
            out.append(ClassBoxes(
                np.array(lo, dtype=np.int64).reshape(-1, ndim), np.array(hi, dtype=np.int64).reshape(-1, ndim),
                np.array(pos, dtype=np.int64), np.array(idx, dtype=np.int64),
            ))
        return tuple(out)

    def same_states(self, other: "Layout") -> None:
        """Raise ValueError unless ``other`` describes the same states (names, shapes, dtypes, same order)."""
        a = [(s.name, s.shape, s.dtype) for s in self.states]
        b = [(s.name, s.shape, s.dtype) for s in other.states]
        if a != b:
            diff = next(((x, y) for x, y in zip(a, b) if x != y), None)
            raise ValueError(
                f"the two layouts describe different states ({len(a)} vs {len(b)}; first difference {diff}): "
                "build both from the same model and state kind"
            )
