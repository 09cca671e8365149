"""The switch checksum is invariant to the layout and catches any changed or moved element."""

import torch

from dynatrain.engine.verify import compare, local_checksums
from dynatrain.vps import ParallelConfig
from dynatrain.vps.layout import Layout, StateSpec

SPECS = (
    StateSpec("w", (10, 6), "float32", tp_dim=0),
    StateSpec("v", (5, 8), "bfloat16", tp_dim=1),
    StateSpec("n", (7,), "float32"),
)


def global_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g).to(getattr(torch, s.dtype)) for s in SPECS}


def shards_of(layout: Layout, full: dict[str, torch.Tensor], process: int) -> dict[str, torch.Tensor]:
    out = {}
    for spec in layout.states:
        sh = layout.shards(spec.name, process)
        t = torch.zeros(sh.local_shape, dtype=full[spec.name].dtype)
        for box, off in zip(sh.boxes, sh.offsets):
            t[tuple(slice(o, o + n) for o, n in zip(off, box.shape))] = full[spec.name][box.slices()]
        out[spec.name] = t
    return out


def summed(layout: Layout, per_process: dict[int, dict[str, torch.Tensor]]) -> list[int]:
    total = [0] * len(layout.states)
    for p, tensors in per_process.items():
        total = [a + b for a, b in zip(total, local_checksums(layout, p, tensors))]
    return total


def test_same_state_in_different_layouts_matches_and_corruption_is_named():
    full = global_state()
    old = Layout.from_config(SPECS, ParallelConfig(dp_replicate=2, dp_shard=2))
    new = Layout.from_config(SPECS, ParallelConfig(dp_shard=2, tp=2), rank_map=[3, 1, 2, 0])
    old_sums = summed(old, {p: shards_of(old, full, p) for p in old.processes})
    new_parts = {p: shards_of(new, full, p) for p in new.processes}
    assert compare(old, old_sums, new, summed(new, new_parts)) == []

    new_parts[2]["v"].view(-1)[3] += 1  # one element changed
    assert compare(old, old_sums, new, summed(new, new_parts)) == ["v"]


def test_swapped_elements_are_caught():
    full = global_state()
    layout = Layout.from_config(SPECS, ParallelConfig(dp_shard=2))
    sums = summed(layout, {p: shards_of(layout, full, p) for p in layout.processes})
    swapped = {k: v.clone() for k, v in full.items()}
    swapped["w"][[0, 1]] = swapped["w"][[1, 0]]
    other = summed(layout, {p: shards_of(layout, swapped, p) for p in layout.processes})
    assert compare(layout, sums, layout, other) == ["w"]
