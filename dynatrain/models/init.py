"""Layout-independent initialisation.

Every parameter is drawn in fixed row blocks, each block from its own generator seeded by
(model seed, parameter name, block index). A rank that holds any box of a parameter generates only
the blocks its rows touch, so every layout, on any number of ranks, starts from bit-identical weights.
"""

from __future__ import annotations

import zlib

import torch

_BLOCK_ELEMENTS = 1 << 20


def rows_per_block(global_shape: tuple[int, ...]) -> int:
    row = 1
    for d in global_shape[1:]:
        row *= d
    return max(1, _BLOCK_ELEMENTS // max(row, 1))


def _block_seed(seed: int, name: str, block: int) -> int:
    return (zlib.crc32(f"{seed}:{name}:{block}".encode()) << 16) ^ block


def init_std(name: str, model_dim: int, n_layers: int) -> float | None:
    """None means "ones" (norm weights); otherwise the normal std of that parameter."""
    if name.endswith("norm.weight"):
        return None
    if name.startswith("output."):
        return model_dim ** -0.5
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "moe.experts.w2", "shared_expert.w2.weight")):
        # Residual-branch outputs are scaled down with depth, as in GPT-2 / torchtitan.
        return 0.02 / (2 * n_layers) ** 0.5
    return 0.02


def init_slice(
    name: str,
    global_shape: tuple[int, ...],
    offset: tuple[int, ...],
    local_shape: tuple[int, ...],
    std: float | None,
    seed: int,
) -> torch.Tensor:
    """The box ``[offset, offset + local_shape)`` of the parameter's global initial value (fp32, CPU)."""
    if std is None:
        return torch.ones(local_shape, dtype=torch.float32, device="cpu")
    out = torch.empty(local_shape, dtype=torch.float32, device="cpu")
    if out.numel() == 0:
        return out
    lo, hi = offset[0], offset[0] + local_shape[0]
    rpb = rows_per_block(global_shape)
    cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], local_shape[1:]))
    for block in range(lo // rpb, (hi - 1) // rpb + 1):
        b_lo, b_hi = block * rpb, min((block + 1) * rpb, global_shape[0])
        gen = torch.Generator(device="cpu").manual_seed(_block_seed(seed, name, block))
        rows = torch.randn((b_hi - b_lo, *global_shape[1:]), generator=gen, device="cpu") * std
        s_lo, s_hi = max(lo, b_lo), min(hi, b_hi)
        out[s_lo - lo : s_hi - lo] = rows[(slice(s_lo - b_lo, s_hi - b_lo), *cols)]
    return out
