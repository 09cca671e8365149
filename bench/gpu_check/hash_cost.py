"""Part (c): what the switch's check costs on the device: seconds per GiB of `check.hashing.indexed_checksum` (the
GPU hashes in parts of bounded size), float32 and bfloat16, and the memory its temporaries take beyond the tensor
(``max_memory_allocated`` over the hash): at most `hashing._DEVICE_TEMP_BYTES` plus the allocator's rounding.

    python bench/gpu_check/hash_cost.py --device cuda --out /tmp/c.json
"""

from __future__ import annotations

import time

import common
import torch


def add_args(ap) -> None:
    ap.add_argument("--gib", type=float, default=None, help="default: 2 on CUDA, 1/64 on the CPU")
    ap.add_argument("--repeats", type=int, default=3)


def run(args, device: torch.device) -> dict:
    from dynatrain.check import hashing
    from dynatrain.check.int64 import wrap64

    cuda = device.type == "cuda"
    gib = args.gib or (2.0 if cuda else 1 / 64)
    rows, checks = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        cols = 4096
        rows_n = max(1, int(gib * 2**30) // (dtype.itemsize * cols))
        t = torch.randn(rows_n, cols, device=device).to(dtype)
        ix = [range(rows_n), range(cols)]
        reference = hashing.indexed_checksum(t[:64].cpu(), [range(64), ix[1]], (rows_n, cols))
        bounded = hashing._checksum(t[:64], [range(64), ix[1]], (rows_n, cols), bounded=True)
        same = wrap64(int(bounded)) == reference  # on the CPU: the bounded way against the matrix products
        times = []
        if cuda:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(args.repeats):
            start = time.perf_counter()
            hashing.indexed_checksum(t, ix, (rows_n, cols))  # its one host transfer waits for the device
            times.append(time.perf_counter() - start)
        nbytes = t.numel() * t.element_size()
        temporaries = torch.cuda.max_memory_allocated(device) - base if cuda else None
        name = str(dtype).removeprefix("torch.")
        rows.append({"dtype": name, "bytes": nbytes, "s_per_gib": min(times) / (nbytes / 2**30),
                     "s_per_gib_each": [x / (nbytes / 2**30) for x in times], "temporaries_bytes": temporaries})
        checks[f"{name}_equals_the_cpu_hash"] = same
        if cuda:
            checks[f"{name}_temporaries_bounded"] = temporaries <= hashing._DEVICE_TEMP_BYTES + (64 << 20)
        del t
    return {"gib": gib, "hashes": rows, "checks": checks}


if __name__ == "__main__":
    common.run_part("hash_cost", __doc__, run, add_args)
