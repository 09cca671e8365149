"""What the layout policy is given: the devices at hand, the workload one optimizer step trains, and the cost
model's knobs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dynatrain.models.registry import ZooConfig, get_zoo_config
from dynatrain.planner.network import NetworkModel
from dynatrain.vps.layout import DTYPE_ITEMSIZE, STATE_KINDS

GiB = 1 << 30
DEFAULT_SWITCH_BUDGET = 256 << 20  # the strategy's default switch_budget_mb


@dataclass(frozen=True)
class Devices:
    """The devices at hand. ``flops``: peak FLOP/s of one device in the compute dtype; ``efficiency``: the
    fraction of it that training reaches (model FLOPs utilisation). ``network`` defaults to the routing
    planner's model with ``gpus_per_node = per_node``; device ``i`` lives on node ``i // per_node``."""

    count: int
    memory_bytes: int
    per_node: int
    flops: float
    efficiency: float = 0.4
    network: NetworkModel | None = None

    def __post_init__(self) -> None:
        for name in ("count", "memory_bytes", "per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Devices.{name} must be a positive integer, got {value!r}")
        if not self.flops > 0:
            raise ValueError(f"Devices.flops must be positive, got {self.flops!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Devices.efficiency is a fraction of peak in (0, 1], got {self.efficiency!r}")
        if self.network is None:
            object.__setattr__(self, "network", NetworkModel(gpus_per_node=self.per_node))
        elif self.network.gpus_per_node != self.per_node:
            raise ValueError(
                f"Devices.per_node={self.per_node} but network.gpus_per_node={self.network.gpus_per_node}: "
                "give the network model the same devices per node"
            )

    def with_count(self, count: int) -> "Devices":
        return Devices(count, self.memory_bytes, self.per_node, self.flops, self.efficiency, self.network)


CHECKPOINTING_ORDER = ("none", "selective:op", "selective:2", "full")  # the order the search tries them in


def _canonical_checkpointing(value) -> str:
    """The spelling of `models.checkpointing.ActivationCheckpointing` (parsed the same way; the policy imports no
    torch)."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    mode, _, option = str(value).strip().lower().partition(":")
    if mode in ("none", "full", "auto") and not option:
        return mode
    if mode == "selective":
        if option in ("", "op"):
            return "selective:op"
        if option.isdigit() and int(option) >= 1:
            return "full" if int(option) == 1 else f"selective:{int(option)}"
    raise ValueError(f"Workload.activation_checkpointing={value!r}: use 'none', 'full', 'selective:op' (per op), "
                     "'selective:N' (every N-th block, N >= 1) or 'auto' (the search picks per layout)")


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains. ``state_kind`` names the routed states as in `vps.layout.STATE_KINDS`
    (``fp32-adam``: fp32 weights + fp32 Adam moments, what the strategy keeps). ``compute_dtype`` is the dtype
    FSDP gathers parameters in and activations are kept in (the strategy's ``param_dtype``; ``float32`` without
    mixed precision); ``reduce_dtype`` the dtype of the gradient reduction. ``activation_checkpointing`` is the
    strategy's policy (``none``, ``full``, ``selective:op``, ``selective:N``; kept in its canonical spelling), or
    ``auto``: the search takes, per layout, the first of `CHECKPOINTING_ORDER` whose memory fits.
    ``loss_parallel``: with tp > 1 the logits stay split over the vocabulary (the strategy's default)."""

    model: ZooConfig | str
    seq_len: int
    global_batch: int
    micro_batch: int = 1
    state_kind: str = "fp32-adam"
    compute_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    sequence_parallel: bool = False
    fused_attention: bool = True
    pipeline: bool = True  # pp layouts are candidates (the module can be split into stages)
    activation_checkpointing: str = "none"
    loss_parallel: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", get_zoo_config(self.model))
        object.__setattr__(self, "activation_checkpointing", _canonical_checkpointing(self.activation_checkpointing))
        for name in ("seq_len", "global_batch", "micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive integer, got {value!r}")
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds max_seq_len={self.model.max_seq_len} of model {self.model.name!r}"
            )
        if self.state_kind not in STATE_KINDS:
            raise ValueError(f"unknown state kind {self.state_kind!r}; choose one of {', '.join(STATE_KINDS)}")
        for name in ("compute_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPE_ITEMSIZE:
                raise ValueError(f"Workload.{name}={getattr(self, name)!r} is not one of {', '.join(DTYPE_ITEMSIZE)}")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter element of all routed states (weight, master copy, Adam moments)."""
        return sum(DTYPE_ITEMSIZE[dtype] for _, dtype in STATE_KINDS[self.state_kind])

    @property
    def grad_bytes(self) -> int:
        # FSDP2 hands the reduced gradient back in the dtype of the sharded weight.
        return DTYPE_ITEMSIZE[STATE_KINDS[self.state_kind][0][1]]

    @property
    def checkpoint_every(self) -> int:
        """Every how many blocks one is checkpointed whole: 0 for none and for selective:op, 1 for full."""
        ac = self.activation_checkpointing
        if ac == "auto":
            raise ValueError("activation_checkpointing='auto' names no policy: the search resolves it per layout "
                             "(estimate_layout); give estimate_memory a workload with one policy")
        return 0 if ac in ("none", "selective:op") else 1 if ac == "full" else int(ac.partition(":")[2])

    def with_checkpointing(self, policy: str) -> "Workload":
        return dataclasses.replace(self, activation_checkpointing=policy)

    @property
    def weight_dtype(self) -> str:
        return STATE_KINDS[self.state_kind][0][1]


@dataclass(frozen=True)
class CostModel:
    """Knobs of the model that are not facts about the hardware or the job.

    ``reserve_fraction``: memory kept free for the allocator's fragmentation, the runtime and communication
    buffers. ``overlap``: the fraction of compute time that can hide data-parallel communication (FSDP
    prefetches the next block's all-gather and reduce-scatters the previous block's gradient while computing);
    1 means ``max(compute, comm)``, 0 means ``compute + comm``. Tensor-parallel all-reduces are never hidden."""

    reserve_fraction: float = 0.1
    overlap: float = 0.8

    def __post_init__(self) -> None:
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction!r}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap!r}")
