from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynatrain.vps.box import Box


def test_intersect_volume_and_empty():
    a, b = Box((0, 0), (4, 6)), Box((2, 3), (8, 4))
    assert a.intersect(b) == Box((2, 3), (4, 4))
    assert a.intersect(b).numel == 2 and a.numel == 24
    far = a.intersect(Box((5, 0), (6, 6)))
    assert far.is_empty and far.numel == 0 and far.shape == (0, 6)
    assert Box((3,), (1,)).is_empty and Box((3,), (1,)).hi == (3,)  # clamped, never negative


def test_contains_shift_offset_slices():
    shard = Box((4, 0), (8, 6))
    piece = Box((5, 2), (7, 6))
    assert shard.contains(piece) and not piece.contains(shard)
    local = piece.shift(shard.lo)
    assert local == Box((1, 2), (3, 6))
    assert local.offset(shard.lo) == piece
    arr = np.arange(48).reshape(8, 6)
    assert np.array_equal(arr[piece.slices()], arr[4:8, :][local.slices()])
    with pytest.raises(ValueError, match="starts before origin"):
        Box((1, 0), (2, 1)).shift((2, 0))


def test_bad_boxes_are_refused():
    with pytest.raises(ValueError, match="as many lower as upper"):
        Box((0,), (1, 2))
    with pytest.raises(ValueError, match="non-negative"):
        Box((-1,), (2,))
    with pytest.raises(ValueError, match="cannot intersect"):
        Box((0,), (1,)).intersect(Box((0, 0), (1, 1)))


def test_from_offset_and_full():
    assert Box.from_offset((2, 3), (4, 5)) == Box((2, 3), (6, 8))
    assert Box.full((3, 4)) == Box((0, 0), (3, 4))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_element_range_is_the_row_major_range(shape, data):
    origin = tuple(data.draw(st.integers(0, 3)) for _ in shape)
    box = Box.from_offset(origin, tuple(shape))
    n = box.numel
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    glob = np.arange(int(np.prod([o + s for o, s in zip(origin, shape)]))).reshape(
        [o + s for o, s in zip(origin, shape)])
    parts = box.element_range(start, stop)
    assert len(parts) <= 2 * len(shape) - 1
    got = np.concatenate([glob[p.slices()].reshape(-1) for p in parts]) if parts else np.zeros(0, int)
    assert np.array_equal(got, glob[box.slices()].reshape(-1)[start:stop])
    assert all(box.contains(p) and not p.is_empty for p in parts)


def test_element_range_refuses_out_of_range():
    with pytest.raises(ValueError, match="outside a box of 6"):
        Box((0, 0), (2, 3)).element_range(2, 7)
