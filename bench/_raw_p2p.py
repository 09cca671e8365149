"""The wire's own speed for a switch's traffic: the same bytes between the same ordered pairs, nothing else."""

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


def raw_exchange(pairs: dict[tuple[int, int], int], rank: int, chunk: int, repeats: int) -> list[float]:
    """The same bytes between the same ordered pairs, all posted at once in one `batch_isend_irecv`, each pair's
    bytes as messages of at most ``chunk`` bytes, from/to preallocated, pre-touched buffers. Seconds per repeat
    (barrier to the last wait on this rank)."""
    sends = {d: n for (s, d), n in pairs.items() if s == rank}
    recvs = {s: n for (s, d), n in pairs.items() if d == rank}
    sbuf = {d: torch.ones(n, dtype=torch.uint8) for d, n in sends.items()}
    rbuf = {s: torch.zeros(n, dtype=torch.uint8) for s, n in recvs.items()}
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
