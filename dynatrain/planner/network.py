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

import numpy as np

from dynatrain.planner.pair_bytes import sum_by


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
        rows = np.array(list(messages), dtype=np.int64).reshape(-1, 3)
        return self._round_seconds(rows[:, 0], rows[:, 1], rows[:, 2])

    def _round_seconds(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> float:
        if not len(src):
            return 0.0
        a, b = src // self.gpus_per_node, dst // self.gpus_per_node
        inter = np.where(a != b, nbytes, 0)
        worst = 0.0
        # Sums straight into arrays indexed by process id: a 16,384-rank round has millions of messages, and
        # masking them per link kind would copy each of them several times. Integer byte sums below 2**53 are exact
        # in float64; dividing by one rate keeps the order.
        for ids in (src, dst):
            top = int(ids.max()) + 1
            every, gpu_inter = sum_by(ids, nbytes, top), sum_by(ids, inter, top)
            node_inter = sum_by(np.arange(top) // self.gpus_per_node, gpu_inter, -(-top // self.gpus_per_node))
            worst = max(worst, float((every - gpu_inter).max()) / self.intra_bytes_per_s,
                        float(gpu_inter.max()) / self.gpu_inter_bytes_per_s,
                        float(node_inter.max()) / self.node_inter_bytes_per_s)
        return worst + self.round_latency_s

    def predict_seconds(self, traffic: Iterable[Iterable[tuple[int, int, int, int]]]) -> float:
        """Seconds for a plan's rounds, as `SwitchPlan.traffic` lists them: (src, dst, offset, bytes)."""
        total = 0.0
        for rnd in traffic:
            if hasattr(rnd, "nbytes") and hasattr(rnd, "src"):  # a round held as arrays (`rounds.Slices`)
                total += self._round_seconds(rnd.src, rnd.dst, rnd.nbytes)
            else:
                rows = np.array([(s, d, n) for s, d, _, n in rnd], dtype=np.int64).reshape(-1, 3)
                total += self._round_seconds(rows[:, 0], rows[:, 1], rows[:, 2])
        return total
