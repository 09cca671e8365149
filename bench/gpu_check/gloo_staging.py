"""A test shim for two ranks on one GPU: NCCL refuses two ranks on one device, so the engine's point-to-point
operations on CUDA tensors are staged through host memory and sent with gloo. Only the wire changes; the engine's
CUDA path (device allocations, the copies, packing and unpacking on the device, its memory accounting) runs as it
would under NCCL. Not for training: every byte crosses the host twice."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _StagedWork:
    """Waits for gloo, then copies what arrived into the CUDA tensors the engine posted."""

    def __init__(self, works: list, arrivals: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.works, self.arrivals = works, arrivals

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait()
        for device_tensor, host in self.arrivals:
            device_tensor.copy_(host)
        self.arrivals = []
        return True


def install(every_tensor: bool = False) -> None:
    """Replace `torch.distributed.batch_isend_irecv` in this process (the engine looks it up at every call).
    ``every_tensor``: stage CPU tensors too (the CPU fallback, so that the shim's own path runs there)."""
    real = dist.batch_isend_irecv

    def staged(ops: list[dist.P2POp]) -> list:
        host_ops, arrivals = [], []
        for op in ops:
            t = op.tensor
            if every_tensor or t.device.type != "cpu":
                sending = op.op in (dist.isend, dist.send)
                host = t.to("cpu", copy=True) if sending else torch.empty(t.shape, dtype=t.dtype)
                if not sending:
                    arrivals.append((t, host))
                op = dist.P2POp(op.op, host, peer=None if op.group_peer is not None else op.peer, group=op.group,
                                tag=op.tag, group_peer=op.group_peer)
            host_ops.append(op)
        works = real(host_ops) if host_ops else []
        return [_StagedWork(list(works), arrivals)] if host_ops else []

    dist.batch_isend_irecv = staged
