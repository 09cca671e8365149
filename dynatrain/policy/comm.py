"""Bandwidth time of the collectives a training step runs, on the network model of the devices at hand. A group is
summarised by its size, the nodes it spans and its thinnest node (whose links are the bottleneck)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from dynatrain.policy.inputs import Devices
from dynatrain.vps.parallel_config import ParallelConfig


@dataclass(frozen=True)
class Group:
    size: int
    nodes: int      # nodes its members span
    per_node: int   # fewest members on one of those nodes: that node's links are the bottleneck


def _group(positions: Sequence[int], per_node: int) -> Group:
    counts = Counter(p // per_node for p in positions)
    return Group(len(positions), len(counts), min(counts.values()))


def dp_groups(cfg: ParallelConfig, per_node: int) -> tuple[Group, Group]:
    """The FSDP (dp_shard x cp) and dp_replicate groups through position 0 (mesh order (r*S + s)*T + t, S =
    dp_shard * cp); the others are translations of them."""
    r, s, t = cfg.dp_replicate, cfg.fsdp_shard, cfg.tp
    shard = [i * t for i in range(s)]
    replicate = [i * s * t for i in range(r)]
    return _group(shard, per_node), _group(replicate, per_node)


def cp_group(cfg: ParallelConfig, per_node: int) -> Group:
    """The cp group through position 0: ``cp`` positions ``tp`` apart."""
    return _group([i * cfg.tp for i in range(cfg.cp)], per_node)


def expert_groups(cfg: ParallelConfig, per_node: int) -> tuple[Group, Group]:
    """The ep and efsdp groups through position 0: an ep group is ``ep`` consecutive dp_shard indices, an efsdp
    group every ``ep``-th one."""
    t = cfg.tp
    ep = [i * t for i in range(cfg.ep)]
    efsdp = [i * cfg.ep * t for i in range(cfg.efsdp)]
    return _group(ep, per_node), _group(efsdp, per_node)


def tp_spans_nodes(cfg: ParallelConfig, per_node: int) -> bool:
    t = cfg.tp
    return any((g * t) // per_node != (g * t + t - 1) // per_node for g in range(cfg.world_size // t))


def inter_share(devices: Devices) -> float:
    """Inter-node bytes/s one device gets while every device of its node communicates at once."""
    net = devices.network
    busy = min(devices.per_node, devices.count)
    return min(net.gpu_inter_bytes_per_s, net.node_inter_bytes_per_s / busy)


def collective_seconds(nbytes: float, group: Group, devices: Devices, all_reduce: bool) -> float:
    """Bandwidth time of one ring all-gather / reduce-scatter (or all-reduce) of an ``nbytes`` buffer.

    Every member receives ``(n-1)/n`` of the buffer (twice for an all-reduce), mostly over intra-node edges;
    the part that originates on other nodes enters each node once and is spread over that node's members'
    inter-node links."""
    n = group.size
    if n == 1 or nbytes == 0:
        return 0.0
    passes = 2 if all_reduce else 1
    net = devices.network
    intra = passes * nbytes * (n - 1) / n / net.intra_bytes_per_s
    if group.nodes == 1:
        return intra
    k = group.per_node
    inter = passes * nbytes * (n - k) / n / (k * inter_share(devices))
    return max(inter, intra if k > 1 else 0.0)


def all_to_all_seconds(nbytes: float, group: Group, devices: Devices) -> float:
    """Bandwidth time of one all-to-all in which every member sends ``nbytes``, spread evenly over the members
    (its own share stays): the share for members on other nodes leaves over the inter-node links."""
    n = group.size
    if n == 1 or nbytes == 0:
        return 0.0
    net = devices.network
    k = group.per_node
    intra = nbytes * (k - 1) / n / net.intra_bytes_per_s
    inter = nbytes * (n - k) / n / inter_share(devices)
    return max(intra, inter)
