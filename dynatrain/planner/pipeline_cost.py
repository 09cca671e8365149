"""The pipeline-parallel terms of the layout cost model (docs/layouts.md, "Pipeline parallelism").

The schedule costed is 1F1B with one stage per pp rank (torch's `Schedule1F1B`), which the policy offers; the stage
split comes in from the caller (`models.stage_split`, the one the runtime uses), so this module stays pure. A step
runs its ``A`` micro-batches (the gradient-accumulation count) through the pipeline:

* pp rank ``k`` runs ``pp - k`` forwards before its first backward and then alternates, so it holds the
  activations of up to ``min(pp - k, A)`` micro-batches: the first stage the most, the last one;
* the step lasts ``A + pp - 1`` slots of the slowest stage, ``A`` of them busy: the bubble is
  ``(pp - 1) / (A + pp - 1)`` of the step, i.e. ``(pp - 1) / A`` of the slowest stage's busy time;
* every micro-batch crosses each stage boundary twice, its activations forward and their gradient backward, in
  equal bytes; a middle stage receives and sends at once (links are full duplex).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageLoad:
    """What one pp rank runs: ``layers`` transformer blocks, the embedding when ``first``, the final norm, the
    output projection and the loss when ``last``."""

    coordinate: int
    layers: int
    first: bool
    last: bool


def stage_loads(split: Sequence[tuple[int, int]], pp: int) -> tuple[StageLoad, ...]:
    """Per pp coordinate, its load under the ``[lo, hi)`` layer ranges of ``split`` (stage ``j`` on coordinate
    ``j % pp``, so more than ``pp`` ranges means interleaved stages)."""
    if len(split) % pp:
        raise ValueError(f"{len(split)} stages do not spread evenly over pp={pp} ranks")
    layers = [0] * pp
    for j, (lo, hi) in enumerate(split):
        layers[j % pp] += hi - lo
    last = (len(split) - 1) % pp
    return tuple(StageLoad(k, layers[k], k == 0, k == last) for k in range(pp))


def in_flight(pp: int, coordinate: int, micro_batches: int) -> int:
    """Micro-batches whose activations pp rank ``coordinate`` holds at once under 1F1B."""
    return min(pp - coordinate, micro_batches)


def bubble_seconds(busiest: float, pp: int, micro_batches: int) -> float:
    """Idle time of a 1F1B step whose slowest stage is busy ``busiest`` seconds over ``micro_batches``."""
    return busiest * (pp - 1) / micro_batches


def p2p_seconds(activation_bytes: float, micro_batches: int, bytes_per_s: float, latency_s: float) -> float:
    """Point-to-point time of one pp rank over a step: per micro-batch, its activations forward and their gradient
    backward across a stage boundary (``activation_bytes`` each way), at ``bytes_per_s`` per link."""
    return micro_batches * 2 * (activation_bytes / bytes_per_s + latency_s)


def boundary_inside_node(world_size: int, per_node: int) -> bool:
    """Whether every stage boundary stays inside a node. Position ``q`` sends to ``q + stage_size``, so once the
    job spans nodes some boundary crosses one (the pipeline goes at the pace of its slowest boundary)."""
    return world_size <= per_node


def stage_params(load: StageLoad, block: int, embedding: int, head: int) -> int:
    """Parameters of pp rank ``load`` given one block's, the embedding's and the head's (final norm, output)."""
    return load.layers * block + (embedding if load.first else 0) + (head if load.last else 0)


def stage_activation_bytes(load: StageLoad, per_layer: float, final_norm: float, edge: float) -> float:
    """Activation bytes per token of one micro-batch on pp rank ``load``: its blocks', the final norm's on the last
    stage, and ``edge`` bytes for each stage boundary it touches (it keeps its input to send the gradient back and
    its output to run backward from)."""
    edges = (not load.first) + (not load.last)
    return load.layers * per_layer + (final_norm if load.last else 0.0) + edges * edge


def tp_all_reduces(load: StageLoad) -> int:
    """TP activation all-reduces of one micro-batch on pp rank ``load``: two per block forward and two backward,
    the embedding's output on the first stage, the output projection's input gradient on the last."""
    return 4 * load.layers + load.first + load.last


@dataclass(frozen=True)
class StageTerms:
    """One pp rank's seconds over a step: what keeps it busy in its pipeline slots (compute, TP all-reduces, expert
    all-to-alls, sends to its neighbours) and its data-parallel traffic, ``hidden`` of which overlaps compute."""

    compute: float
    tp: float
    p2p: float
    fsdp: float
    hsdp: float
    hidden: float
    ep: float = 0.0

    @property
    def busy(self) -> float:
        return self.compute + self.tp + self.ep + self.p2p

    @property
    def exposed(self) -> float:
        return self.fsdp + self.hsdp - self.hidden


def pipeline_step(terms: Sequence[StageTerms], micro_batches: int) -> tuple[StageTerms, StageTerms, float]:
    """(the slowest pp rank, which sets every slot; the rank with the most exposed data-parallel traffic; the
    bubble): a step lasts ``slowest.busy + bubble + exposed.exposed``. Ties go to the earlier rank."""
    slowest = max(terms, key=lambda t: t.busy)
    exposed = max(terms, key=lambda t: t.exposed)
    return slowest, exposed, bubble_seconds(slowest.busy, len(terms), micro_batches)
