"""The wire's own speed for a switch's traffic: the same bytes between the same ordered pairs, nothing else.

Two limits: `raw_exchange` posts every byte at once (no memory bound: both ends hold whole buffers), and
`budget_exchange` moves the same bytes in rounds that pass at most the switch's budget through each process (what
it sends plus what it receives), as any transfer under that budget must: the engine's own bound, without its
packing, local copies or planning."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def pair_bytes(plan) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for rnd in plan.traffic:
        for s, d, _, n in rnd:
            out[(s, d)] = out.get((s, d), 0) + n
    return out


def _buffers(pairs: dict[tuple[int, int], int], rank: int) -> tuple[dict, dict]:
    """This rank's send buffers per receiver and receive buffers per sender, allocated and touched."""
    sbuf = {d: torch.ones(n, dtype=torch.uint8) for (s, d), n in pairs.items() if s == rank}
    rbuf = {s: torch.zeros(n, dtype=torch.uint8) for (s, d), n in pairs.items() if d == rank}
    return sbuf, rbuf


def budget_rounds(pairs: dict[tuple[int, int], int], budget: int) -> list[list[tuple[int, int, int]]]:
    """The pairs' bytes cut into as few rounds of ``(src, dst, nbytes)`` as let no process send plus receive more
    than ``budget`` bytes in one round: every pair moves an equal share in each round (both directions of a link at
    once), and every process derives the same rounds."""
    if budget < 1:
        raise ValueError(f"budget must be at least one byte, got {budget}")
    pairs = {p: n for p, n in sorted(pairs.items()) if n > 0}
    load: dict[int, int] = {}
    links: dict[int, int] = {}
    for (s, d), n in pairs.items():
        for p in (s, d):
            load[p] = load.get(p, 0) + n
            links[p] = links.get(p, 0) + 1
    if any(links[p] >= budget for p in links):
        raise ValueError(f"a budget of {budget} bytes is too small for {max(links.values())} peers")
    # A pair's share in a round exceeds n / count by less than a byte, so a process's round stays within
    # load / count + links bytes.
    count = max([-(-load[p] // (budget - links[p])) for p in load], default=0)
    rounds = [[(s, d, n * (k + 1) // count - n * k // count) for (s, d), n in pairs.items()
               if n * (k + 1) // count > n * k // count] for k in range(count)]
    return [rnd for rnd in rounds if rnd]


def budget_exchange(pairs: dict[tuple[int, int], int], rank: int, budget: int, repeats: int) -> list[float]:
    """`budget_rounds` on the wire: each round one `batch_isend_irecv` between preallocated, pre-touched buffers,
    waited before the next. Seconds per repeat (barrier to the last wait on this rank)."""
    rounds = budget_rounds(pairs, budget)
    sbuf, rbuf = _buffers(pairs, rank)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        sent = dict.fromkeys(sbuf, 0)
        got = dict.fromkeys(rbuf, 0)
        for rnd in rounds:
            ops = []
            for s, d, n in rnd:
                if s == rank:
                    ops.append(dist.P2POp(dist.isend, sbuf[d][sent[d]:sent[d] + n], peer=d))
                    sent[d] += n
                elif d == rank:
                    ops.append(dist.P2POp(dist.irecv, rbuf[s][got[s]:got[s] + n], peer=s))
                    got[s] += n
            for w in (dist.batch_isend_irecv(ops) if ops else []):
                w.wait()
        times.append(time.perf_counter() - t0)
    del sbuf, rbuf
    return times


def raw_exchange(pairs: dict[tuple[int, int], int], rank: int, chunk: int, repeats: int) -> list[float]:
    """The same bytes between the same ordered pairs, all posted at once in one `batch_isend_irecv`, each pair's
    bytes as messages of at most ``chunk`` bytes, from/to preallocated, pre-touched buffers. Seconds per repeat
    (barrier to the last wait on this rank)."""
    sbuf, rbuf = _buffers(pairs, rank)
    times = []
    for _ in range(repeats):
        ops = []
        for d in sorted(sbuf):
            b = sbuf[d]
            for o in range(0, b.numel(), chunk):
                ops.append(dist.P2POp(dist.isend, b[o:o + chunk], peer=d))
        for s in sorted(rbuf):
            b = rbuf[s]
            for o in range(0, b.numel(), chunk):
                ops.append(dist.P2POp(dist.irecv, b[o:o + chunk], peer=s))
        dist.barrier()
        t0 = time.perf_counter()
        works = dist.batch_isend_irecv(ops) if ops else []
        for w in works:
            w.wait()
        times.append(time.perf_counter() - t0)
        del works, ops
    del sbuf, rbuf
    return times
