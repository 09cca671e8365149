"""The placed checksum indexes every element by what its tensor says: equal for the same state in any layout
(FSDP2 + TP, pure FSDP2, HSDP, TP), and names a swapped shard, a changed scalar and a disagreeing holder.

Run as a script (by `test_same_state_in_other_layouts_and_mutations`) it is the worker of 4 gloo ranks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dynatrain.check.hashing import indexed_checksum
from dynatrain.check.module_states import module_state_tensors
from dynatrain.check.placement import placed_indices
from dynatrain.check.scalars import scalar_hash
from dynatrain.check.state_sums import StateSums, differing, explain, local_sums


def added(*ranks: StateSums) -> StateSums:
    """What `reduce` gives for these ranks' local sums (wrapping as int64 does)."""
    from dynatrain.check.int64 import wrap64

    vectors = [r.vector() for r in ranks]
    return StateSums.from_vector(ranks[0].names, [wrap64(sum(col)) for col in zip(*vectors)])


# ----------------------------------------------------------------------------------------------------------------
# One process.


M64 = (1 << 64) - 1
DTYPES = [torch.bool, torch.int8, torch.uint8, torch.float8_e4m3fn, torch.int16, torch.float16, torch.bfloat16,
          torch.int32, torch.float32, torch.int64, torch.float64, torch.complex64]


def random_bits(shape, dtype, g) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (0 or 1 for bool): every bit pattern, NaNs included."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (math.prod(shape) * size,), dtype=torch.uint8,
                        generator=g)
    return raw.view(dtype).reshape(shape)


def reference(full: torch.Tensor) -> int:
    """The checksum of a whole tensor by its definition (the comment above `indexed_checksum`), unit by unit."""
    from dynatrain.check.hash_weights import ROW as _ROW
    from dynatrain.check.int64 import wrap64

    def a(r):  # splitmix64, odd
        z = (r + 0x9E3779B97F4A7C15) & M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return (z ^ (z >> 31)) | 1

    def b(c):  # 2 * g(c) + 1, g a bijection of 31 bits
        m = (1 << 31) - 1
        z = c ^ 0x2545F491
        z = ((z ^ (z >> 16)) * 0x045D9F3B) & m
        z = ((z ^ (z >> 15)) * 0x2C1B3C6D) & m
        return (z ^ (z >> 16)) * 2 + 1

    size = full.element_size()
    unit = min(size, 4)
    data = full.contiguous().reshape(-1).view(torch.uint8).tolist()
    shape = list(full.shape) or [1]
    shape[-1] *= size // unit
    t, width = len(shape), 1
    while t > 0 and width * shape[t - 1] <= _ROW:
        t, width = t - 1, width * shape[t - 1]
    if t == len(shape):
        width = shape[-1]
    per_row = -(-width // _ROW)
    total = 0
    for f in range(len(data) // unit):
        digits = data[f * unit:(f + 1) * unit]
        v = sum((d - 256 * (d >= 128)) << (8 * k) for k, d in enumerate(digits))  # signed base-256 digits
        row, col = divmod(f, width)
        total += a(row * per_row + col // _ROW) * b(col % _ROW) * v
    return wrap64(total)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def both_ways(monkeypatch, local, indices, shape) -> int:
    """`indexed_checksum` by int8 matrix products and elementwise: asserts they agree and leave ``local`` as it
    was."""
    from dynatrain.check import hash_weights

    kept = local.clone()
    fast = indexed_checksum(local, indices, shape)
    with monkeypatch.context() as m:
        m.setitem(hash_weights._tables, "int_mm", False)
        slow = indexed_checksum(local, indices, shape)
    assert fast == slow, (tuple(shape), local.dtype)
    assert torch.equal(raw(local), raw(kept))
    return fast


def test_int8_matrix_products_are_exact_on_an_x86_cpu():
    """Where they are not (or missing), the elementwise way hashes: the same sums, slower."""
    from dynatrain.check.hash_weights import int_mm_exact as _int_mm_exact

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"CPU capability {torch.backends.cpu.get_cpu_capability()}: no int8 matrix product expected")
    assert _int_mm_exact()  # so the tests below compare the matrix products with the elementwise way


def test_checksum_is_its_definition_for_every_dtype_both_ways(monkeypatch):
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        shapes = [(), (1,), (5,), (3, 4, 5), (7, 30), (4, 3, 3, 2)]
        if dtype in (torch.int8, torch.bfloat16, torch.float32, torch.float64):  # a last dimension longer than
            shapes.append((2, 9000) if dtype.itemsize == 8 else (2, 17000))  # a hash row, in every unit size
        for shape in shapes:
            full = random_bits(shape, dtype, g)
            want = reference(full)
            assert both_ways(monkeypatch, full, [range(n) for n in shape], shape) == want, (dtype, shape)
            assert indexed_checksum(full, [torch.arange(n) for n in shape], shape) == want, (dtype, shape)
    big = torch.randn(300, 700, generator=g)  # the matrix product on many rows, and a non-contiguous local
    assert indexed_checksum(big, [range(300), range(700)], (300, 700)) == reference(big)
    assert indexed_checksum(big.t(), [range(700), range(300)], (700, 300)) == reference(big.t().contiguous())


def test_weights_are_odd_distinct_and_their_digits_exact():
    from dynatrain.check.hash_weights import COLUMNS as _COLUMNS
    from dynatrain.check.hash_weights import DIGITS as _DIGITS
    from dynatrain.check.hash_weights import ROW as _ROW
    from dynatrain.check.hash_weights import row_weight as _row_weight
    from dynatrain.check.hash_weights import row_weights as _row_weights
    from dynatrain.check.hash_weights import weights as _weights

    b, digits, powers = _weights(4, torch.device("cpu"), True)
    assert bool((b % 2 == 1).all()) and len(set(b.tolist())) == _ROW and 0 < int(b.min()) and int(b.max()) < 1 << 32
    assert digits.dtype == torch.int8 and int(digits.min()) >= -64 and int(digits.max()) < 64
    assert digits.shape == (4 * _ROW, _COLUMNS) and not bool(digits[:, _DIGITS:].any())
    assert torch.equal((digits.to(torch.int64) * powers).sum(1), (b[:, None] << (8 * torch.arange(4))).reshape(-1))
    rows = torch.tensor([0, 1, 2, 12345, (1 << 40) + 3, (1 << 62) - 1])
    assert _row_weights(rows).tolist() == [_row_weight(r) for r in rows.tolist()]
    assert all(w % 2 for w in _row_weights(torch.arange(1000)).tolist())


def cut(n: int, g: torch.Generator, how: str) -> list:
    """Index lists that partition range(n): uneven contiguous ranges, random subsets, or strided runs."""
    if how == "ranges":
        ends = sorted({0, n, *torch.randint(1, max(2, n), (2,), generator=g).tolist()})
        return [range(a, b) for a, b in zip(ends[:-1], ends[1:]) if b > a]
    if how == "subsets":
        owner = torch.randint(0, 3, (n,), generator=g)
        return [torch.nonzero(owner == k).flatten() for k in range(3) if bool((owner == k).any())]
    step = min(3, n)  # `_StridedShard`-like: every third index from each start
    return [torch.arange(k, n, step) for k in range(step)]


def test_any_partition_of_a_tensor_sums_to_the_whole(monkeypatch):
    import itertools

    g = torch.Generator().manual_seed(4)
    cases = [((5, 6, 7), torch.float32), ((4, 3, 9000), torch.bfloat16), ((3, 2, 20000), torch.float32),
             ((2, 3, 9000), torch.float64), ((50000,), torch.float32), ((6, 5, 4), torch.int8),
             ((60, 17000), torch.float32)]  # rows enough for matrix products, cut into several hash rows
    for shape, dtype in cases:
        full = random_bits(shape, dtype, g)
        whole = both_ways(monkeypatch, full, [range(n) for n in shape], shape)
        for how in ("ranges", "subsets", "strided"):
            total = 0
            for parts in itertools.product(*[cut(n, g, how) for n in shape]):
                local = full
                for d, ix in enumerate(parts):
                    local = local.index_select(d, torch.arange(ix.start, ix.stop) if isinstance(ix, range) else ix)
                total += both_ways(monkeypatch, local, list(parts), shape)
            assert (total - whole) % (1 << 64) == 0, (shape, dtype, how)


def test_moved_and_flipped_values_change_the_sum():
    g = torch.Generator().manual_seed(5)

    def changed(full, other):
        shape = tuple(full.shape)
        ix = [range(n) for n in shape]
        return indexed_checksum(full, ix, shape) != indexed_checksum(other, ix, shape)

    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int8):
        full = (torch.randn(64, 300, generator=g) * 50).to(dtype)
        full[3, 7], full[3, 8] = 1, -1  # a value and its negation: they differ in the sign bit alone
        for a, b in [((3, 7), (3, 8)), ((0, 1), (0, 299)), ((0, 1), (40, 1)), ((5, 5), (6, 9))]:
            other = full.clone()
            other[a], other[b] = full[b], full[a]
            assert not torch.equal(other, full) and changed(full, other), (dtype, a, b)
        for r1, r2 in [(0, 1), (10, 63)]:  # two rows exchanged
            other = full.clone()
            other[[r1, r2]] = full[[r2, r1]]
            assert changed(full, other), (dtype, r1, r2)
        assert changed(full, full.roll(1, 1)) and changed(full, full.roll(1, 0))
        for bit in range(8 * full.element_size()):  # every single bit of one element flipped
            other = full.clone()
            raw(other[2, 5:6])[bit // 8] ^= 1 << (bit % 8)
            assert changed(full, other), (dtype, bit)
    zero = torch.zeros(4, 10, dtype=torch.float64)
    other = zero.clone()
    other[1, 3] = -0.0
    assert changed(zero, other)
    moved = zero.clone()
    moved[1, 4] = -0.0  # the same -0.0 one column on
    assert changed(other, moved)
    long = torch.randn(40000, generator=g)  # a vector of several hash rows: values moved across them
    other = long.clone()
    other[[5, 39000]] = long[[39000, 5]]
    assert changed(long, other)


def test_threads_split_the_tasks_without_changing_the_sum(monkeypatch):
    g = torch.Generator().manual_seed(3)
    t = torch.randn(2200, 1000, generator=g)  # 8.8 MB: above the size hashed on one thread
    ix = [range(100, 2300), range(5, 1005)]
    before = torch.get_num_threads()
    try:
        sums = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            sums.append(both_ways(monkeypatch, t, ix, (2400, 1010)))
            assert torch.get_num_threads() == threads  # given back after the hash held torch at one thread
    finally:
        torch.set_num_threads(before)
    assert sums[0] == sums[1] == sums[2]


def test_the_gpus_bounded_parts_cover_each_element_once_and_sum_alike(monkeypatch):
    """The way a GPU hashes (parts of at most a fixed number of units, summed on the device), run on the CPU with a
    small limit: every part within it, every element in exactly one part, the sum bit for bit the whole's."""
    from dynatrain.check import hashing
    from dynatrain.check.hashing import _checksum, bounded_parts
    from dynatrain.check.int64 import wrap64

    limit = 1000
    monkeypatch.setattr(hashing, "_CHUNK_ACCELERATOR", limit)
    g = torch.Generator().manual_seed(6)
    cases = [((), torch.float32), ((5000,), torch.float32), ((3, 5000), torch.bfloat16), ((2, 3, 700), torch.float32),
             ((40, 300), torch.float64), ((17, 1), torch.int8), ((9, 20, 30), torch.float16)]
    for shape, dtype in cases:
        full = random_bits(shape, dtype, g)
        for local, ix in [(full, [range(n) for n in shape]),
                          (full, [torch.randperm(n, generator=g) for n in shape]),  # any global indices
                          (full.transpose(0, -1), [range(n) for n in reversed(shape)])]:  # a non-contiguous local
            glob = tuple(len(i) for i in ix)
            want = indexed_checksum(local, ix, glob)
            assert wrap64(int(_checksum(local, ix, glob, bounded=True))) == want, (shape, dtype)
            per = max(1, local.element_size() // 4)
            ids = torch.arange(local.numel()).reshape(local.shape)
            seen = []
            for part, part_ix in bounded_parts(ids, list(ix), limit // per):
                assert part.numel() <= max(limit // per, 1) and [len(i) for i in part_ix] == list(part.shape)
                seen.append(part.reshape(-1))
            assert torch.equal(torch.cat(seen).sort().values, torch.arange(local.numel())), (shape, dtype)


def test_piece_sums_add_per_state_as_the_pieces_checksums_do():
    from dynatrain.check.hashing import PieceSums
    from dynatrain.check.int64 import wrap64

    g = torch.Generator().manual_seed(8)
    full = torch.randn(30, 50, generator=g)
    boxes = [(0, (0, 0), (10, 50)), (1, (10, 0), (30, 20)), (0, (10, 20), (30, 50)), (1, (0, 0), (0, 50))]
    want = [0, 0]
    before = torch.get_num_threads()
    with PieceSums(2) as sums:
        assert torch.get_num_threads() == 1
        for state, lo, hi in boxes:
            ix = [range(a, b) for a, b in zip(lo, hi)]
            box = full[lo[0]:hi[0], lo[1]:hi[1]]
            sums.add(state, box, ix, (30, 50))
            want[state] += indexed_checksum(box, ix, (30, 50))
    assert torch.get_num_threads() == before
    assert sums.totals() == [wrap64(w) for w in want]
    assert wrap64(sum(sums.totals()[:1])) == wrap64(indexed_checksum(full[:10], [range(10), range(50)], (30, 50))
                                                    + indexed_checksum(full[10:, 20:], [range(10, 30), range(20, 50)],
                                                                       (30, 50)))


def test_non_contiguous_indices_hash_each_element_at_its_own_index():
    g = torch.Generator().manual_seed(1)
    full = torch.randn(8, 5, generator=g)
    even, odd = torch.arange(0, 8, 2), torch.arange(1, 8, 2)
    cols = torch.arange(5)
    whole = indexed_checksum(full, [torch.arange(8), cols], (8, 5))
    parts = indexed_checksum(full[even], [even, cols], (8, 5)) + indexed_checksum(full[odd], [odd, cols], (8, 5))
    assert (whole - parts) % (1 << 64) == 0
    assert indexed_checksum(full[odd], [even, cols], (8, 5)) != indexed_checksum(full[even], [even, cols], (8, 5))
    # Index lists in the last and a middle dimension, over more elements than one chunk holds.
    for shape, d in [((200001,), 0), ((3, 40000, 2), 1), ((2, 3, 50000), 2)]:
        big = torch.randn(shape, generator=g)
        n = shape[d]
        some, rest = torch.arange(0, n, 3), torch.tensor([i for i in range(n) if i % 3])
        ix = [range(k) for k in shape]
        whole = indexed_checksum(big, ix, shape)
        parts = sum(indexed_checksum(big.index_select(d, i), ix[:d] + [i] + ix[d + 1:], shape) for i in (some, rest))
        assert (whole - parts) % (1 << 64) == 0, shape


class FakeMesh:
    """What `_strided_indices` asks of a mesh: its sizes and this rank's coordinate."""

    def __init__(self, shape, coord):
        self.shape, self.coord = shape, coord

    def size(self, d):
        return self.shape[d]

    def get_coordinate(self):
        return list(self.coord)


def test_strided_shard_after_shard_gives_every_index_not_a_box():
    """torch's docstring case S(0), SS(0, split_factor=2) on a 2x2 mesh: rank (0, 1) holds rows 1 and 3, which
    `compute_local_shape_and_global_offset` reports as the box of 2 rows at 1."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    from dynatrain.check.placement import _strided_indices

    for placements in [(Shard(0), _StridedShard(0, split_factor=2)), (_StridedShard(0, split_factor=2), Shard(0)),
                       (_StridedShard(1, split_factor=3), Shard(1))]:
        shape = (8, 12)
        seen = []
        for coord in [(0, 0), (0, 1), (1, 0), (1, 1)]:
            ix = _strided_indices(shape, FakeMesh((2, 2), coord), placements)
            box_shape, offset = _compute_local_shape_and_global_offset(shape, (2, 2), list(coord), placements)
            assert tuple(len(i) for i in ix) == tuple(box_shape)
            assert tuple(int(i[0]) for i in ix) == tuple(offset)
            d = placements[0].dim
            seen += ix[d].tolist()
        assert sorted(seen) == list(range(shape[placements[0].dim]))  # every index once
    first = _strided_indices((8,), FakeMesh((2, 2), (0, 1)), (Shard(0), _StridedShard(0, split_factor=2)))
    assert first[0].tolist() == [1, 3]


def test_plain_tensors_replication_from_held_counts():
    g = torch.Generator().manual_seed(2)
    w, s = torch.randn(6, 4, generator=g), torch.tensor(3.5)
    names = ["w", "s", "gone"]
    one = local_sums({"w": w, "s": s}, {}, names)
    assert one.held == [24, 1, 0] and one.sizes == [24, 1, 0] and one.knowers == [1, 1, 0]
    assert one.sums[0] == indexed_checksum(w, [torch.arange(6), torch.arange(4)], (6, 4))
    # Three ranks each holding everything (replicated) against one: the same state.
    assert differing(added(one, one, one), added(one)) == []
    assert differing(added(one, one), added(one, one)) == []
    # One element changed, on one of two replicas.
    w2 = w.clone()
    w2[1, 2] += 1
    other = local_sums({"w": w2, "s": s}, {}, names)
    assert differing(added(one, one), added(one, other)) == ["w"]
    # Two elements exchanged.
    w3 = w.clone()
    w3[[0, 5]] = w3[[5, 0]]
    assert differing(added(one), added(local_sums({"w": w3, "s": s}, {}, names))) == ["w"]
    # A 0-d tensor is one element; a changed one is named.
    assert differing(added(one), added(local_sums({"w": w, "s": torch.tensor(3.25)}, {}, names))) == ["s"]


def test_inconsistent_replication_and_absent_states_are_named():
    names = ("a", "b", "c", "d")
    zeros = [0] * 4
    # b: held twice before (sum doubled), once after: the same state.
    good = StateSums(names, sums=[5, 14, 9, 0], held=[4, 8, 1, 0], sizes=[4, 4, 1, 0], knowers=[1, 1, 1, 0],
                     squares=zeros, bad=zeros)
    odd = StateSums(names, sums=[5, 7, 9, 0], held=[6, 4, 1, 0], sizes=[8, 4, 1, 3], knowers=[2, 1, 1, 1],
                    squares=zeros, bad=[0, 0, 1, 0], problems={"c": "local shape (2,), its placements give (3,)"})
    why = explain(good, odd)
    assert list(why) == ["a", "c", "d"]
    assert "6 elements held of 4: not a whole number of copies" in why["a"]
    assert "contradicts its own placements" in why["c"] and "placements give" in why["c"]
    assert "held by nobody before" in why["d"]
    assert explain(odd, good)["d"].startswith("held by nobody after")
    single = StateSums(names, [5, 7, 9, 0], [4, 4, 1, 0], [4, 4, 1, 0], [1, 1, 1, 0], zeros, zeros)
    assert differing(good, single) == []
    # The same sums with replication 1 on both sides: b differs (14 against 7).
    assert differing(StateSums(names, [5, 14, 9, 0], [4, 4, 1, 0], [4, 4, 1, 0], [1, 1, 1, 0], zeros, zeros),
                     single) == ["b"]
    # A known state of which nobody holds an element; ranks that disagree on a size.
    assert "0 elements held of 4" in explain(
        StateSums(names, zeros, [0, 4, 1, 0], [4, 4, 1, 0], [1, 1, 1, 0], zeros, zeros), single)["a"]
    assert "disagree on its size" in explain(
        StateSums(names, [5, 7, 9, 0], [4, 4, 1, 0], [7, 4, 1, 0], [2, 1, 1, 0], zeros, zeros), single)["a"]
    with pytest.raises(ValueError, match="different state names"):
        explain(good, StateSums.empty(("x",)))


def test_scalars_and_objects():
    sched = {"last_epoch": 3, "_last_lr": [0.25, 0.5], "base_lrs": (1.0, 2.0), "gamma": 0.5, "lr_lambdas": [None]}
    step = torch.tensor(3.0)
    names = ["p.step", "#scheduler.0", "p.weight_decay"]
    old = local_sums({}, {"p.step": step, "#scheduler.0": sched, "p.weight_decay": 0.0}, names)
    # The same values rebuilt (keys in another order, a tuple for a list): equal, replication from the holders.
    same = {"p.step": step.clone(), "#scheduler.0": dict(reversed(list({**sched, "_last_lr": (0.25, 0.5)}.items()))),
            "p.weight_decay": 0.0}
    assert differing(added(old, old), added(*[local_sums({}, same, names)] * 3)) == []
    # A changed scheduler state and a changed step are named.
    stepped = {**same, "#scheduler.0": {**sched, "last_epoch": 4}}
    assert differing(added(old), added(local_sums({}, stepped, names))) == ["#scheduler.0"]
    assert differing(added(old), added(local_sums({}, {**same, "p.step": torch.tensor(4.0)}, names))) == ["p.step"]
    # The dtype of a 0-d tensor is part of its value; so is -0.0 against 0.0.
    assert differing(added(old), added(local_sums({}, {**same, "p.step": torch.tensor(3.0, dtype=torch.float64)},
                                                  names))) == ["p.step"]
    assert differing(added(old), added(local_sums({}, {**same, "p.weight_decay": -0.0}, names))) == ["p.weight_decay"]
    # Holders that disagree are named even where the old and new totals would match.
    other = local_sums({}, {**same, "p.step": torch.tensor(9.0)}, names)
    assert "do not all hold the same value" in explain(added(old, other), added(old, other))["p.step"]
    # The name is part of the hash: one value under another name is another state.
    assert scalar_hash("a", 1) != scalar_hash("b", 1)
    assert scalar_hash("a", 1) != scalar_hash("a", True) != scalar_hash("a", 1.0)


def test_module_state_tensors_names_like_capture():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched.step()
    tensors, scalars = module_state_tensors(net, opt, [sched])
    assert sorted(tensors) == sorted(
        [f"{p}{k}" for p in ("0.weight", "0.bias", "1.weight", "1.bias") for k in ("", ".exp_avg", ".exp_avg_sq")]
        + ["1.running_mean", "1.running_var", "1.num_batches_tracked"])
    assert sorted(scalars) == sorted([f"{p}.step" for p in ("0.weight", "0.bias", "1.weight", "1.bias")]
                                     + ["#param_group.0", "#scheduler.0"])
    assert tensors["0.weight"] is not net[0].weight and torch.equal(tensors["0.weight"], net[0].weight)
    assert scalars["#param_group.0"]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    names = sorted({*tensors, *scalars})
    before = local_sums(tensors, scalars, names)
    assert differing(added(before), added(local_sums(*module_state_tensors(net, opt, [sched]), names))) == []
    sched.step()
    with torch.no_grad():
        net[1].running_mean[0] += 1
    after = local_sums(*module_state_tensors(net, opt, [sched]), names)
    assert differing(added(before), added(after)) == ["#param_group.0", "#scheduler.0", "1.running_mean"]


# ----------------------------------------------------------------------------------------------------------------
# Four gloo ranks: real FSDP2 + TP placements.


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_same_state_in_other_layouts_and_mutations(tmp_path):
    from _launch import launch

    results = launch(str(Path(__file__).resolve()), 4, [], tmp_path, timeout=120)
    for r in results:
        gathered, reduced = r["sum_ints"]
        assert gathered == reduced == [6, 6, -10, 6], gathered
        assert r["index_problems"] == [], r["index_problems"][:5]
        assert r["strided"], "no parameter of the FSDP2 + TP model carried a _StridedShard"
        assert r["uneven"], "no shard of the FSDP2 + TP model was smaller than another"
        assert r["equal"] == {"fsdp4": {}, "hsdp2x2": {}, "tp4": {}}, r["equal"]
        assert sorted(r["swapped"]) == ["blocks.0.w1.weight"], r["swapped"]
        assert sorted(r["strided_swapped"]) == ["blocks.1.w1.weight"], r["strided_swapped"]
        assert sorted(r["step_changed"]) == ["blocks.1.w2.bias.step"], r["step_changed"]
        assert "do not all hold the same value" in r["step_changed"]["blocks.1.w2.bias.step"]
        assert r["all_changed"] == {"#param_group.0": "values differ", "#scheduler.0": "values differ",
                                    "norm.weight.step": "values differ"}, r["all_changed"]
        assert sorted(r["old_vs_old"]) == [], r["old_vs_old"]
        assert list(r["short"]) == ["blocks.0.w2.weight"], r["short"]
        assert "1 rank(s) hold a local tensor that contradicts its own placements" in r["short"]["blocks.0.w2.weight"]
        assert r["off_mesh"] == {} and list(r["off_mesh_wrong"]) == ["v"], (r["off_mesh"], r["off_mesh_wrong"])
    assert [r["off_mesh_held"] for r in results] == [4, 2, 0, 0]
    # Replication came from the tensors: the TP-replicated norm twice in 2x2 (tp copies), 4 times under tp=4.
    reps = results[0]["replication"]
    assert reps["2x2"]["norm.weight"] == 2 and reps["tp4"]["norm.weight"] == 4 and reps["hsdp2x2"]["norm.weight"] == 2
    assert reps["2x2"]["blocks.0.w1.weight"] == 1 and reps["fsdp4"]["blocks.0.w1.weight"] == 1
    assert reps["2x2"]["blocks.0.w1.bias.step"] == 4  # a scalar: its holders


class Block(nn.Module):
    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(hidden=30)])  # 30 rows: uneven shards (8 and 7 under 2x2)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("scale", torch.arange(16, dtype=torch.float32))
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.norm(x) * self.scale


def build(layout: str) -> nn.Module:
    """The same values (every rank builds them from one seed), parallelised by torch for ``layout``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    net = Net()
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    if layout == "2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for b in net.blocks:
            parallelize_module(b, mesh["tp"], plan)
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(net, mesh=mesh["dp"])
    elif layout == "fsdp4":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        for b in net.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(net, mesh=mesh)
    elif layout == "hsdp2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        for b in net.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(net, mesh=mesh)
    elif layout == "tp4":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        for b in net.blocks:
            parallelize_module(b, mesh, plan)
    else:
        raise ValueError(layout)
    return net


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor().detach() if isinstance(t, DTensor) else t


def index_problems(tensors: dict[str, torch.Tensor], where: str) -> tuple[list[str], list[str]]:
    """Per DTensor, whether `placed_indices` picks out of the gathered whole exactly the local tensor, and whether
    torch's box (`compute_local_shape_and_global_offset`) does too (FSDP2 over TP places `_StridedShard` on the
    dp dimension before TP's Shard: the box is right there; `test_strided_shard_after_shard...` has a case where
    it is not)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    problems, strided = [], []
    for name, t in tensors.items():
        whole = full(t)  # every rank gathers the same tensors in the same order
        if not isinstance(t, DTensor):
            continue
        if any(isinstance(p, _StridedShard) for p in t.placements):
            strided.append(f"{name} {t.placements}")
        cut = whole
        for d, i in enumerate(placed_indices(t)):
            cut = cut.index_select(d, torch.arange(i.start, i.stop) if isinstance(i, range) else i)
        if not torch.equal(cut, t.to_local()):
            problems.append(f"{where} {name} {t.placements}: the indices do not cut the local tensor out")
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        box = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        if not torch.equal(box, t.to_local()):
            problems.append(f"{where} {name} {t.placements}: torch's box {shape} at {offset} is not the local tensor")
    return problems, strided


def copy_into(new: nn.Module, new_opt, wholes: dict[str, torch.Tensor], old_opt, old_sched, new_sched) -> None:
    """The old state's values, by name, into the new module's tensors (each cut by torch's own distribute)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    tensors, scalars = module_state_tensors(new, new_opt)
    with torch.no_grad():
        for name, t in tensors.items():
            if isinstance(t, DTensor):
                t.to_local().copy_(distribute_tensor(wholes[name], t.device_mesh, t.placements).to_local())
            else:
                t.copy_(wholes[name])
        for name, v in scalars.items():
            if name.endswith(".step"):
                v.copy_(wholes[name])
    for group, old in zip(new_opt.param_groups, old_opt.param_groups):
        group.update({k: v for k, v in old.items() if k != "params"})
    new_sched.load_state_dict(old_sched.state_dict())


def swapped(name: str, pair: tuple[int, int], tensors, scalars):
    """``tensors`` and ``scalars`` where the ranks of ``pair`` hold each other's local shard of DTensor ``name``
    (a new DTensor on the same mesh with the same placements: the module is left as it is)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    w = tensors[name]
    local = w.to_local().detach().contiguous()
    rank = dist.get_rank()
    if rank in pair:
        peer = pair[1] if rank == pair[0] else pair[0]
        other = torch.empty_like(local)
        ops = [dist.P2POp(dist.isend, local, peer), dist.P2POp(dist.irecv, other, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert not torch.equal(other, local)
        local = other
    fake = DTensor.from_local(local, w.device_mesh, w.placements, shape=w.shape, stride=w.stride())
    return {**tensors, name: fake}, scalars


def make_optimizer(net: nn.Module, real_step: bool):
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for p in net.parameters():
        p.grad = p.detach() * 0.5 + 1 if real_step else torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    if real_step:
        sched.step()
    return opt, sched


def worker(out: str) -> None:
    import json

    import torch.distributed as dist

    from functools import partial

    from dynatrain.runtime import control_group
    from dynatrain.check import state_sums

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # The sums travel on the control group, as in a switch.
    group = control_group.new_control_group()
    all_names, compare, reduce = (partial(f, group=group) for f in (state_sums.all_names, state_sums.compare,
                                                                     state_sums.reduce))
    rank = dist.get_rank()
    result: dict = {"rank": rank, "equal": {}, "replication": {}}
    # The check's sums, gathered and summed on each rank, wrap as the all-reduce does.
    values = [rank, (1 << 62) + rank, -(rank + 1), -(1 << 63) + rank]
    result["sum_ints"] = [control_group.sum_ints(values, group), control_group.all_reduce_ints(values, group)]

    def replication(sums: StateSums) -> dict[str, int]:
        s = reduce(sums)
        return {n: s.held[i] // max(1, s.sizes[i] // max(1, s.knowers[i])) for i, n in enumerate(s.names)}

    old = build("2x2")
    old_opt, old_sched = make_optimizer(old, real_step=True)
    tensors, scalars = module_state_tensors(old, old_opt, [old_sched])
    names = all_names(tensors, scalars)
    result["index_problems"], result["strided"] = index_problems(tensors, "2x2")
    w = tensors["blocks.1.w1.weight"].to_local()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(4)]
    dist.all_gather(sizes, torch.tensor([w.shape[0]]))
    result["uneven"] = len({int(x) for x in sizes}) > 1
    wholes = {name: full(t) for name, t in tensors.items()}
    wholes.update({n: v for n, v in scalars.items() if n.endswith(".step")})
    old_sums = local_sums(tensors, scalars, names)
    result["old_vs_old"] = compare(old_sums, local_sums(tensors, scalars, names))
    result["replication"]["2x2"] = replication(old_sums)
    # Ranks 0 and 1 (one dp rank, tp 0 and 1) exchange their shards of a `_StridedShard` parameter: named.
    result["strided_swapped"] = compare(old_sums, local_sums(*swapped("blocks.1.w1.weight", (0, 1), tensors, scalars),
                                                             names))
    # A local tensor its placements do not give (one row short on rank 0): named on every rank, nobody hangs.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    w = tensors["blocks.0.w2.weight"]
    short = DTensor.from_local(w.to_local()[:-1] if rank == 0 else w.to_local(), w.device_mesh, w.placements,
                               shape=w.shape, stride=w.stride())
    result["short"] = compare(old_sums, local_sums({**tensors, "blocks.0.w2.weight": short}, scalars, names))
    # A DTensor on a mesh of ranks 0 and 1 (2 and 3 hold nothing) against the whole on rank 3 alone.
    values = torch.arange(6.0).reshape(3, 2) * 1.5
    pair = DeviceMesh("cpu", [0, 1])
    part = values[:2] if rank == 0 else values[2:] if rank == 1 else torch.empty(0, 2)
    on_pair = DTensor.from_local(part, pair, [Shard(0)], shape=values.shape, stride=values.stride())
    result["off_mesh_held"] = local_sums({"v": on_pair}, {}, ["v"]).held[0]
    result["off_mesh"] = compare(local_sums({"v": on_pair}, {}, ["v"]),
                                 local_sums({"v": values} if rank == 3 else {}, {}, ["v"]))
    result["off_mesh_wrong"] = compare(local_sums({"v": on_pair}, {}, ["v"]),
                                       local_sums({"v": values.flip(0)} if rank == 3 else {}, {}, ["v"]))
    kept = {}
    for layout in ("fsdp4", "hsdp2x2", "tp4"):
        new = build(layout)
        new_opt, new_sched = make_optimizer(new, real_step=False)
        copy_into(new, new_opt, wholes, old_opt, old_sched, new_sched)
        new_tensors, new_scalars = module_state_tensors(new, new_opt, [new_sched])
        problems, _ = index_problems(new_tensors, layout)
        result["index_problems"] += problems
        new_sums = local_sums(new_tensors, new_scalars, names)
        result["equal"][layout] = compare(old_sums, new_sums)
        result["replication"][layout] = replication(new_sums)
        kept[layout] = (new, new_opt, new_sched)

    # Mutation 1: ranks 0 and 1 exchange their local shards of one parameter (equal shapes, different rows).
    new, new_opt, new_sched = kept["fsdp4"]
    new_state = module_state_tensors(new, new_opt, [new_sched])
    result["swapped"] = compare(old_sums, local_sums(*swapped("blocks.0.w1.weight", (0, 1), *new_state), names))

    # Mutation 2: Adam's step of one parameter changed on one rank.
    b = dict(new.named_parameters())["blocks.1.w2.bias"]
    if rank == 2:
        new_opt.state[b]["step"] += 1
    result["step_changed"] = compare(old_sums, local_sums(*module_state_tensors(new, new_opt, [new_sched]), names))
    if rank == 2:
        new_opt.state[b]["step"] -= 1

    # Mutation 3: on every rank alike, another step and the scheduler (holders agree, but not with before).
    new_opt.state[dict(new.named_parameters())["norm.weight"]]["step"] += 1
    new_sched.step()
    result["all_changed"] = compare(old_sums, local_sums(*module_state_tensors(new, new_opt, [new_sched]), names))

    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    worker(parser.parse_args().out)
