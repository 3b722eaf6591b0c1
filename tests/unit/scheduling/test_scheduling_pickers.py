"""The built-in pickers: counts, distinctness, order, tie-breaking and proportions."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from tests.unit.scheduling.builders import endpoint, request

from endpoint_picker.scheduling.plugins import MaxScorePicker, RandomPicker, WeightedRandomPicker

PICKERS = [MaxScorePicker, RandomPicker, WeightedRandomPicker]


def names(picked: object) -> list[str]:
    return [e.endpoint.pod_name for e in picked]  # type: ignore[attr-defined]


@pytest.mark.parametrize("picker_type", PICKERS)
@pytest.mark.parametrize(("k", "n", "expected"), [(1, 5, 1), (3, 5, 3), (4, 2, 2), (2, 1, 1)])
def test_pickers_return_up_to_k_distinct(picker_type: type, k: int, n: int, expected: int) -> None:
    """Every picker returns min(k, n) distinct endpoints."""
    eps = [endpoint(f"e{i}") for i in range(n)]
    for seed in range(20):
        picked = picker_type(k, random.Random(seed)).pick(request(), eps, [0.5] * n)
        assert len(picked) == expected
        assert len(set(names(picked))) == expected


def test_max_score_breaks_ties_at_random() -> None:
    """Equal best scores are chosen among at random, so every tied endpoint gets picked."""
    eps = [endpoint(f"e{i}") for i in range(4)]
    scores = [3.0, 3.0, 1.0, 3.0]
    seen = Counter(
        names(MaxScorePicker(1, random.Random(seed)).pick(request(), eps, scores))[0]
        for seed in range(200)
    )
    assert set(seen) == {"e0", "e1", "e3"}
    assert min(seen.values()) > 40


def test_max_score_fallbacks_are_best_first() -> None:
    """Several endpoints come back in descending score order; ties among them vary by seed."""
    eps = [endpoint(f"e{i}") for i in range(6)]
    scores = [0.1, 0.9, 0.5, 0.7, 0.5, 0.0]
    orders = set()
    for seed in range(50):
        picked = names(MaxScorePicker(4, random.Random(seed)).pick(request(), eps, scores))
        assert picked[:2] == ["e1", "e3"]
        assert set(picked[2:]) == {"e2", "e4"}
        orders.add(tuple(picked))
    assert len(orders) == 2


def test_weighted_random_proportions() -> None:
    """Draw frequencies follow the scores (3:1:0) with a seeded random source."""
    eps = [endpoint("a"), endpoint("b"), endpoint("c")]
    picker = WeightedRandomPicker(1, random.Random(42))
    counts = Counter(names(picker.pick(request(), eps, [3.0, 1.0, 0.0]))[0] for _ in range(4000))
    assert counts["c"] == 0
    assert counts["a"] / 4000 == pytest.approx(0.75, abs=0.03)


def test_weighted_random_all_zero_is_uniform() -> None:
    """When every score is zero the draw is uniform."""
    eps = [endpoint(f"e{i}") for i in range(4)]
    picker = WeightedRandomPicker(1, random.Random(3))
    counts = Counter(names(picker.pick(request(), eps, [0.0] * 4))[0] for _ in range(4000))
    assert all(c / 4000 == pytest.approx(0.25, abs=0.03) for c in counts.values())
    assert len(counts) == 4


def test_weighted_random_fills_fallbacks_with_zero_scores() -> None:
    """Once the positive scores are drawn, the zero-score endpoints fill the remaining slots."""
    eps = [endpoint("a"), endpoint("z1"), endpoint("z2")]
    for seed in range(20):
        picked = names(WeightedRandomPicker(3, random.Random(seed)).pick(request(), eps, [1, 0, 0]))
        assert picked[0] == "a"
        assert set(picked) == {"a", "z1", "z2"}


def test_same_seed_same_picks() -> None:
    """Picks are reproducible: the random source is injected."""
    eps = [endpoint(f"e{i}") for i in range(8)]
    runs = [
        [names(RandomPicker(2, rng).pick(request(), eps, [0.0] * 8)) for _ in range(10)]
        for rng in (random.Random(5), random.Random(5))
    ]
    assert runs[0] == runs[1]
