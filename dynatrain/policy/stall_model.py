"""The whole stall of a switch at scale, phase by phase: forming the target's communicators, building the target,
the transfer, the check, and planning; once with the formation (and build, and plan) inside the stall and once with
them done ahead, while the old world trains. Pure Python: the figures come from the layouts and the routing plan's
byte counts, and the constants below, each with where it comes from (docs/benchmarks.md, "The whole stall,
predicted").

**Communicators** (`NcclInitModel`): a communicator of ``n`` ranks takes ``a + b*n + c*n**2`` seconds to set up on
every member. The form follows what NCCL's set-up does: a fixed part (topology detection, graph search, the
connections to a bounded set of ring and tree peers), bootstrap all-gathers that are rings of ``n - 1`` sequential
steps over TCP (NVIDIA/nccl#1791), and loops over all pairs of ranks in ``ncclBuildRing`` and
``initTransportsRank`` (NVIDIA/nccl#1789). The three constants fit three published figures:

- ``c`` = 26 s / 98,304**2 + 11 s / 49,152**2 = 7.24e-9 s: what NVIDIA/nccl#1789 (Meta, 2025) reports its removal of
  those quadratic loops saved, 26 s of ``ncclBuildRing`` at 96K ranks and 11 s of ``initTransportsRank`` at 48K;
- ``a`` + 8 ``b`` + 64 ``c`` = 2.28 s: one node of 8 H100s, NCCL 2.22.3, 2.46 s per rank of which 0.18 s is the
  CUDA kernels' load that a process pays once (NVIDIA/nccl#534, the comment of 2024-07-22, NCCL's own
  ``Init timings`` line): a training process has paid it already;
- ``a + b*98,304 + c*98,304**2`` = 265 s: stock NCCL's initialisation at 96K GPUs (Meta's NCCLX paper, arXiv
  2510.20171).

So ``a`` = 2.26 s, ``b`` = 1.96 ms per rank: 2.39 s at 64 ranks, 2.52 s at 128, 4.3 s at 1,024, 18.8 s at 8,192. Every
communicator is priced as a fresh ``ncclCommInitRank``: a split from the world's communicator (``ncclCommSplit``,
which torch uses when the world is bound to a device) may share resources and cost less; none of the sources times
one at scale.

**Which communicators a switch forms** (`target_communicators`): the target world's default group (every rank),
one per name of the target mesh (root dimensions and the flattened names `ParallelConfig.flattened_dims` gives) of
two ranks or more that is not the whole world (a group over every rank is the default group itself): the groups
`models.parallelize.connect_mesh_groups` connects one after another, each rank in one group per name. A change that
both adds and drops processes first forms the world the bytes travel on, the old and new processes together
(docs/elastic.md, "union, then target"); a pure scale-out's union is its target, a scale-in travels on the old
world. The control group is gloo (`runtime.control_group`): a TCP connection to each peer,
``GLOO_PER_PEER_S`` each (a gloo ``new_group`` of 2 to 4 ranks takes 1 to 4 ms on this repository's CPU host; a
connection across hosts costs at least that).

**Build** (`BuildCost`): the module parallelised for the target on the meta device and its placements read, per
parameter the rank wraps (its pipeline stage's): ``wrap_s`` for every one, ``tp_s`` more for each one tensor
parallelism splits (DTensor's per-parameter set-up and FSDP2's 2-D meshes, docs/benchmarks.md). Fitted on
`bench/build_cost.py`'s CPU seconds (one core of this repository's host, load average 3.0 to 3.2) for Llama-3-70B:
``dp_shard=64`` 0.186 s for 723 parameters, ``dp_shard=8,tp=8`` 0.525 s with 562 of them split. It under-predicts
the Qwen3-235B-A22B build measured the same way (0.519 against 0.640 s).

**Check** (`CheckCost`): every byte that moves is hashed where it is sent and where it is received
(`check.verify`): the busiest rank's sent plus received bytes at ``s_per_gib``, and a fixed cost per state it
holds, hashed before and after. The measured rate is the CPU's: 0.14 s/GiB of float32 on one thread
(`python bench/check_speed.py --gib 1 --threads 1`), 0.03 ms per state. A GPU
hashes elementwise in bounded parts and has not been measured (`bench/gpu_check/hash_cost.py` does); the copy
bandwidth measured on an H200 (1,948 GiB/s, `bench/results/gpu.json`) with about 7 bytes of memory traffic per byte
hashed (the elementwise way's int32 and int64 temporaries) and its kernel launches suggest about
`GPU_HASH_S_PER_GIB_ESTIMATE`: an estimate, never a default.

The transfer is the routing planner's prediction, planning the time `dynatrain plan` took for one rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dynatrain.models.registry import ZooConfig, get_zoo_config, spec_for
from dynatrain.vps.parallel_config import ParallelConfig

GiB = 1 << 30


@dataclass(frozen=True)
class NcclInitModel:
    """Seconds to set up one NCCL communicator of ``n`` ranks: ``fixed_s + per_rank_s*n + per_pair_s*n**2``."""

    fixed_s: float
    per_rank_s: float
    per_pair_s: float

    def seconds(self, ranks: int) -> float:
        if ranks < 2:
            return 0.0
        return self.fixed_s + self.per_rank_s * ranks + self.per_pair_s * ranks * ranks

    @classmethod
    def fit(cls, small: tuple[int, float], large: tuple[int, float], per_pair_s: float) -> NcclInitModel:
        """The model through two (ranks, seconds) points with the quadratic coefficient given."""
        (n1, t1), (n2, t2) = small, large
        b = ((t2 - per_pair_s * n2 * n2) - (t1 - per_pair_s * n1 * n1)) / (n2 - n1)
        return cls(t1 - b * n1 - per_pair_s * n1 * n1, b, per_pair_s)


# The sources' figures (module docstring): the quadratic loops' cost, one node's set-up without the one-off kernel
# load, and stock NCCL at 96K GPUs.
QUADRATIC_S = 26.0 / 98_304**2 + 11.0 / 49_152**2
ONE_NODE = (8, 2.46 - 0.18)
NCCLX_96K = (98_304, 265.0)
NCCL_INIT = NcclInitModel.fit(ONE_NODE, NCCLX_96K, QUADRATIC_S)
GLOO_PER_PEER_S = 1e-3


@dataclass(frozen=True)
class BuildCost:
    wrap_s: float  # per parameter the rank wraps: copy, FSDP2's set-up, reading its placements
    tp_s: float    # more per parameter tensor parallelism splits

    def seconds(self, wrapped: int, split: int) -> float:
        return self.wrap_s * wrapped + self.tp_s * split


# bench/results/stall_prediction/build_cost.json, Llama-3-70B, CPU seconds: dp_shard=64 and dp_shard=8,tp=8.
BUILD = BuildCost(wrap_s=0.18595 / 723, tp_s=(0.52527 - 0.18595) / 562)


@dataclass(frozen=True)
class CheckCost:
    s_per_gib: float
    s_per_state: float = 0.03e-3
    device: str = "cpu, one thread (measured)"

    def seconds(self, hashed_bytes: int, states: int) -> float:
        return self.s_per_gib * hashed_bytes / GiB + self.s_per_state * 2 * states


CPU_HASH = CheckCost(0.14)
GPU_HASH_S_PER_GIB_ESTIMATE = 0.004


def target_communicators(target: ParallelConfig) -> tuple[int, ...]:
    """The sizes of the mesh groups one rank of ``target`` joins besides the world (see the module docstring)."""
    sizes = dict(zip(target.mesh_dim_names, target.mesh_shape))
    out = [sizes[name] for name in target.mesh_dim_names]
    for dims in target.flattened_dims().values():
        n = 1
        for d in dims:
            n *= sizes[d]
        out.append(n)
    return tuple(n for n in out if 2 <= n < target.world_size)


def _stage_of(name: str, split: tuple[tuple[int, int], ...]) -> int:
    """The pipeline stage that holds a state: a block's by its layer, the embedding on the first, the rest on the
    last (`models.dense_specs.param_stages`' rule)."""
    if name.startswith("layers."):
        layer = int(name.split(".", 2)[1])
        return next(i for i, (lo, hi) in enumerate(split) if lo <= layer < hi)
    return 0 if name.startswith("tok_embeddings.") else len(split) - 1


def wrapped_parameters(model: str | ZooConfig, target: ParallelConfig, stages_per_rank: int = 1) -> tuple[int, int]:
    """(parameters, of which tensor parallelism splits) that the busiest rank of ``target`` wraps: every one
    without pp, its stages' with pp."""
    cfg = get_zoo_config(model)
    spec = spec_for(cfg)
    params = spec.states(cfg, "fp32")
    split_by_tp = [target.tp > 1 and spec.tp_dim(s.name, tuple(s.shape)) is not None for s in params]
    if target.pp == 1:
        return len(params), sum(split_by_tp)
    split = spec.stages(cfg, target.pp, stages_per_rank)
    counts = [[0, 0] for _ in range(target.pp)]
    for s, tp in zip(params, split_by_tp):
        rank = _stage_of(s.name, split) % target.pp
        counts[rank][0] += 1
        counts[rank][1] += tp
    return tuple(max(counts))


@dataclass(frozen=True)
class StallPrediction:
    """Seconds per phase of one switch, on its busiest rank."""

    world: float       # the target world's communicator, after the union's where joiners and leavers meet
    mesh: float        # the target mesh's communicators, one after another
    control: float     # the gloo control group over the target world
    build: float       # the target module parallelised on meta, its placements read
    plan: float        # the routing plan, one rank's share
    transfer: float    # the routing planner's network model
    check: float       # hashing the moved bytes on both sides
    communicators: tuple[int, ...]  # sizes of every communicator formed: the worlds first, then the mesh groups
    worlds: int
    hashed_bytes: int
    wrapped: int
    split: int
    check_rate: str

    @property
    def formation(self) -> float:
        return self.world + self.mesh + self.control

    @property
    def in_stall(self) -> float:
        """Everything at the step boundary."""
        return self.formation + self.build + self.plan + self.transfer + self.check

    @property
    def ahead(self) -> float:
        """Formation, build and plan done while the old world trains: the stall keeps the bytes and their check."""
        return self.transfer + self.check

    @property
    def as_built(self) -> float:
        """What dynatrain does ahead today for a world change known ahead: the world with its mesh's groups and
        its control group, and the plan; the build stays at the boundary."""
        return self.in_stall - self.formation - self.plan

    def as_dict(self) -> dict:
        out = asdict(self)
        out["communicators"] = list(self.communicators)
        out.update(formation=self.formation, in_stall=self.in_stall, ahead=self.ahead, as_built=self.as_built)
        return out


def predict_stall(model: str | ZooConfig, target: ParallelConfig, *, processes_old: int, joining: int,
                  transfer_s: float, plan_s: float, hashed_bytes: int, states_per_parameter: int = 3,
                  stages_per_rank: int = 1, check: CheckCost = CPU_HASH, nccl: NcclInitModel = NCCL_INIT,
                  build: BuildCost = BUILD) -> StallPrediction:
    """The stall of a switch to ``target`` (its world is ``target.world_size`` processes; ``joining`` of them are
    new), whose plan moves ``hashed_bytes`` through its busiest rank (sent plus received) in ``transfer_s``."""
    if joining < 0 or processes_old < 1 or hashed_bytes < 0 or transfer_s < 0 or plan_s < 0:
        raise ValueError(f"bad switch figures: processes_old={processes_old}, joining={joining}, "
                         f"hashed_bytes={hashed_bytes}, transfer_s={transfer_s}, plan_s={plan_s}")
    n = target.world_size
    union = processes_old + joining
    worlds = ([union] if joining and union > n else []) + [n]
    mesh = target_communicators(target)
    wrapped, split = wrapped_parameters(model, target, stages_per_rank)
    return StallPrediction(
        world=sum(nccl.seconds(w) for w in worlds), mesh=sum(nccl.seconds(g) for g in mesh),
        control=GLOO_PER_PEER_S * (n - 1), build=build.seconds(wrapped, split), plan=plan_s, transfer=transfer_s,
        check=check.seconds(hashed_bytes, wrapped * states_per_parameter), communicators=(*worlds, *mesh),
        worlds=len(worlds),
        hashed_bytes=hashed_bytes, wrapped=wrapped, split=split,
        check_rate=f"{check.s_per_gib:g} s/GiB, {check.device}")
