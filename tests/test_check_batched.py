"""`PieceSums` reads the small boxes a switch moves by one int8 matrix product each and weighs all their rows at
once: per state, the sum the element hash defines (`test_check_sums.reference`, unit by unit), for boxes of any dtype
at any global indices, strided shards included; a changed byte or two exchanged elements still change it."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dynatrain.check import hash_weights
from dynatrain.check.hashing import PieceSums, indexed_checksum
from dynatrain.check.int64 import wrap64
from tests.test_check_sums import DTYPES, random_bits, reference


def _runs(n: int, rng: random.Random) -> list:
    """A partition of ``range(n)``: contiguous runs, or (a strided shard) every k-th index from each offset."""
    if n > 1 and rng.random() < 0.3:
        k = rng.randint(2, min(4, n))
        return [torch.arange(o, n, k) for o in range(k)]
    cuts = sorted({0, n, *(rng.randint(1, n - 1) for _ in range(rng.randint(0, 2)) if n > 1)})
    return [range(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def _pieces(full: torch.Tensor, rng: random.Random):
    """(local view, its global indices) of boxes that tile ``full``, each a view inside a larger local tensor (so
    strided in memory), its indices per dimension a run or a strided shard's index list."""
    per_dim = [_runs(n, rng) for n in full.shape]
    out = []
    for choice in itertools.product(*per_dim):
        box = full
        for d, i in enumerate(choice):
            box = box.index_select(d, torch.as_tensor(list(i) if isinstance(i, range) else i))
        local = torch.zeros([n + 1 for n in box.shape], dtype=full.dtype)
        view = local[tuple(slice(0, n) for n in box.shape)]
        view.copy_(box)
        out.append((view, list(choice)))
    return out


CASES = [((), 0), ((7,), 1), ((5, 9), 2), ((4, 3, 6), 3), ((2, 17000), 4), ((3, 2, 2, 5), 5), ((1, 300), 6),
         ((40, 700), 7), ((6, 5, 700), 8)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_sums_are_the_definition_on_random_boxes_strided_shards_included(dtype, monkeypatch):
    g = torch.Generator().manual_seed(3)
    for shape, seed in CASES:
        if shape == (2, 17000) and dtype.itemsize > 2:
            shape = (2, 9000)  # a tensor row longer than a hash row in every unit size: `_checksum` reads these
        full = random_bits(shape, dtype, g)
        pieces = _pieces(full, random.Random(seed))
        with PieceSums(2) as sums:
            for k, (view, ix) in enumerate(pieces):
                sums.add(k % 2, view, ix, shape)
            batched = len(sums._rows)
        assert wrap64(sum(sums.totals())) == reference(full), (dtype, shape)
        per_piece = [0, 0]
        for k, (view, ix) in enumerate(pieces):
            per_piece[k % 2] += indexed_checksum(view, ix, shape)
        assert sums.totals() == [wrap64(x) for x in per_piece], (dtype, shape)
        units = (shape[-1] if shape else 1) * max(1, dtype.itemsize // 4)
        assert batched == (len(pieces) if units <= hash_weights.ROW and hash_weights.int_mm_exact() else 0)
        with monkeypatch.context() as m:  # the elementwise way, as where int8 products are not exact
            m.setitem(hash_weights._tables, "int_mm", False)
            with PieceSums(2) as slow:
                for k, (view, ix) in enumerate(pieces):
                    slow.add(k % 2, view, ix, shape)
                assert not slow._rows
            assert slow.totals() == sums.totals(), (dtype, shape)


def _sums(pieces, shape) -> list[int]:
    with PieceSums(len(pieces)) as sums:
        for k, (view, ix) in enumerate(pieces):
            sums.add(k, view, ix, shape)
        assert len(sums._rows) == len(pieces) or not hash_weights.int_mm_exact()
        return sums.totals()


def test_a_changed_byte_or_exchanged_elements_change_their_states_sum_alone():
    g = torch.Generator().manual_seed(5)
    shape = (12, 40)
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float64):
        full = random_bits(shape, dtype, g)
        pieces = [(full[:6, :20], [range(0, 6), range(0, 20)]), (full[6:, :20], [range(6, 12), range(0, 20)]),
                  (full[::2, 20:], [torch.arange(0, 12, 2), range(20, 40)]),
                  (full[1::2, 20:], [torch.arange(1, 12, 2), range(20, 40)])]
        clean = _sums(pieces, shape)
        assert wrap64(sum(clean)) == reference(full)
        for k in range(len(pieces)):
            for trial in range(5):  # one byte of piece k flipped, anywhere
                bad = [(v.clone(), ix) for v, ix in pieces]
                raw = bad[k][0].view(torch.uint8).view(-1)
                raw[trial * 7 % raw.numel()] ^= 1 << (trial % 8)
                got = _sums(bad, shape)
                assert got[k] != clean[k] and got[:k] + got[k + 1:] == clean[:k] + clean[k + 1:], (dtype, k)
        # Two different elements exchanged within a piece, or a strided shard's rows taken for its neighbour's.
        swapped = [(v.clone(), ix) for v, ix in pieces]
        row = swapped[0][0]
        row[0, 0], row[0, 1] = pieces[0][0][0, 1].clone(), pieces[0][0][0, 0].clone()
        if not torch.equal(row, pieces[0][0]):
            assert _sums(swapped, shape)[0] != clean[0]
        shifted = pieces[:2] + [(pieces[3][0], pieces[2][1]), (pieces[2][0], pieces[3][1])]
        if not torch.equal(pieces[2][0], pieces[3][0]):
            assert wrap64(sum(_sums(shifted, shape))) != wrap64(sum(clean))


def test_a_box_whose_indices_do_not_fit_it_is_refused():
    local = torch.zeros(4, 6)
    with PieceSums(1) as sums:
        with pytest.raises(ValueError, match="local box of shape"):
            sums.add(0, local[:, :3], [range(4), range(6)], (4, 6))
        sums.add(0, torch.zeros(()), [], ())  # a 0-d tensor is its one element
        sums.add(0, torch.zeros(1), [range(1)], ())
