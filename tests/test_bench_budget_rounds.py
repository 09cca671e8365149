"""The raw baseline under a budget (`bench/_raw_p2p.budget_rounds`): every byte once, no process over the budget in
any round, and no more rounds than its busiest process needs."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _raw_p2p import budget_rounds  # noqa: E402


def _check(pairs: dict[tuple[int, int], int], budget: int) -> list:
    rounds = budget_rounds(pairs, budget)
    moved: dict[tuple[int, int], int] = {}
    for rnd in rounds:
        through: dict[int, int] = {}
        for s, d, n in rnd:
            assert n > 0
            moved[(s, d)] = moved.get((s, d), 0) + n
            through[s] = through.get(s, 0) + n
            through[d] = through.get(d, 0) + n
        assert max(through.values()) <= budget
    assert moved == {p: n for p, n in pairs.items() if n}
    return rounds


def test_both_directions_of_a_link_share_every_round():
    rounds = _check({(0, 1): 150, (1, 0): 150}, 64)
    assert len(rounds) == 5
    assert all(sorted((s, d) for s, d, _ in rnd) == [(0, 1), (1, 0)] for rnd in rounds)


def test_random_traffic_moves_every_byte_within_the_budget():
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(2, 6)
        budget = rng.randint(12, 500)
        pairs = {(s, d): rng.randint(0, 400) for s in range(n) for d in range(n) if s != d and rng.random() < 0.6}
        rounds = _check(pairs, budget)
        busiest = max([sum(v for (s, d), v in pairs.items() if p in (s, d)) for p in range(n)], default=0)
        assert len(rounds) >= -(-busiest // budget)


def test_a_budget_below_one_byte_per_peer_is_refused():
    with pytest.raises(ValueError, match="too small"):
        budget_rounds({(0, 1): 10, (0, 2): 10}, 2)
