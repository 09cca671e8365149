"""A bandwidth model that turns a plan's rounds into predicted seconds.

Assumptions (also in docs/planner.md):
* Process ``p`` runs on node ``p // gpus_per_node``.
* Inside a node every GPU can send and receive ``intra_node_gbps`` at once to any peer (NVSwitch-like
  full bisection); intra-node and inter-node traffic use different links and overlap.
* Between nodes each GPU drives its own share of the node's NICs (rail-aligned, as NCCL does):
  ``link_gbps * max(1, nics_per_node / gpus_per_node)`` per GPU and direction, and a node as a whole at most
  ``nics_per_node * link_gbps`` per direction. Links are full duplex; the switch fabric is non-blocking.
* A round lasts as long as its most loaded link (GPU or node, either direction), plus a fixed
  ``round_latency_s`` for posting, synchronising and the first byte. Rounds run one after another.
* Packing and unpacking staging buffers and local copies run at memory bandwidth and are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class NetworkModel:
    gpus_per_node: int = 8
    link_gbps: float = 200.0
    nics_per_node: int = 8
    intra_node_gbps: float = 3200.0
    round_latency_s: float = 20e-6

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nics_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("link_gbps", "intra_node_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.round_latency_s < 0:
            raise ValueError(f"round_latency_s must be >= 0, got {self.round_latency_s}")

    def node_of(self, process: int) -> int:
        return process // self.gpus_per_node

    @property
    def gpu_inter_bytes_per_s(self) -> float:
        return self.link_gbps * max(1.0, self.nics_per_node / self.gpus_per_node) * 1e9 / 8

    @property
    def node_inter_bytes_per_s(self) -> float:
        return self.link_gbps * self.nics_per_node * 1e9 / 8

    @property
    def intra_bytes_per_s(self) -> float:
        return self.intra_node_gbps * 1e9 / 8

    def round_seconds(self, messages: Iterable[tuple[int, int, int]]) -> float:
        """Seconds for one round of (src, dst, bytes) messages; 0 for an empty round."""
        loads: dict[tuple, int] = {}
        any_message = False
        for src, dst, n in messages:
            any_message = True
            a, b = self.node_of(src), self.node_of(dst)
            kind = "intra" if a == b else "inter"
            for key in ((kind, "out", src), (kind, "in", dst)):
                loads[key] = loads.get(key, 0) + n
            if a != b:
                for key in (("node", "out", a), ("node", "in", b)):
                    loads[key] = loads.get(key, 0) + n
        if not any_message:
            return 0.0
        rate = {"intra": self.intra_bytes_per_s, "inter": self.gpu_inter_bytes_per_s,
                "node": self.node_inter_bytes_per_s}
        worst = max(n / rate[key[0]] for key, n in loads.items())
        return worst + self.round_latency_s

    def predict_seconds(self, traffic: Iterable[Iterable[tuple[int, int, int, int]]]) -> float:
        """Seconds for a plan's rounds, as `SwitchPlan.traffic` lists them: (src, dst, offset, bytes)."""
        return sum(self.round_seconds((s, d, n) for s, d, _, n in rnd) for rnd in traffic)
