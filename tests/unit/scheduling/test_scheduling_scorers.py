"""The built-in scorers' values."""

from __future__ import annotations

import random

import pytest
from tests.unit.scheduling.builders import endpoint, request

from endpoint_picker.scheduling.plugins import (
    KVCacheUtilizationScorer,
    LoraAffinityScorer,
    QueueScorer,
    RunningRequestsSizeScorer,
)


@pytest.mark.parametrize(
    ("queues", "expected"),
    [
        ([0, 5, 10], [1.0, 0.5, 0.0]),
        ([3, 3, 3], [1.0, 1.0, 1.0]),
        ([7], [1.0]),
        ([2, 0, 8, 4], [0.75, 1.0, 0.0, 0.5]),
    ],
)
def test_queue_scorer_min_max(queues: list[int], expected: list[float]) -> None:
    """Shortest queue scores 1, longest 0, linear between; all equal scores 1 everywhere."""
    eps = [endpoint(queue=q) for q in queues]
    assert QueueScorer().score(request(), eps) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("running", "expected"),
    [([0, 4, 8], [1.0, 0.5, 0.0]), ([5, 5], [1.0, 1.0]), ([9, 1], [0.0, 1.0])],
)
def test_running_requests_scorer_min_max(running: list[int], expected: list[float]) -> None:
    """Fewest running requests scores 1, most scores 0; all equal scores 1."""
    eps = [endpoint(running=r) for r in running]
    assert RunningRequestsSizeScorer().score(request(), eps) == pytest.approx(expected)


def test_kv_cache_scorer_is_free_fraction() -> None:
    """The KV scorer is 1 - usage (clamping out-of-range usage is the runner's job)."""
    eps = [endpoint(kv=k) for k in (0.0, 0.25, 1.0)]
    assert KVCacheUtilizationScorer().score(request(), eps) == pytest.approx([1.0, 0.75, 0.0])


@pytest.mark.parametrize(
    ("active", "waiting", "max_lora", "expected"),
    [
        (["a"], [], 2, 1.0),  # running
        (["a", "b"], [], 2, 1.0),  # running beats a full endpoint
        (["b"], [], 2, 0.8),  # free slot
        (["b"], ["a"], 4, 0.8),  # free slot outranks "waiting" (precedence as documented)
        (["b"], ["a"], 2, 0.6),  # waiting, no free slot
        (["b", "c"], [], 2, 0.0),  # full, not here
        ([], [], 0, 0.0),  # no LoRA support at all
    ],
)
def test_lora_affinity_precedence(
    active: list[str], waiting: list[str], max_lora: int, expected: float
) -> None:
    """LoRA affinity: running 1.0, else free slot 0.8, else waiting 0.6, else 0."""
    ep = endpoint(active=active, waiting=waiting, max_lora=max_lora)
    assert LoraAffinityScorer().score(request("a"), [ep]) == [expected]


def test_scorers_keep_endpoint_order() -> None:
    """Scores align with the endpoints they were given, whatever their order."""
    rng = random.Random(7)
    queues = [rng.randrange(20) for _ in range(16)]
    eps = [endpoint(queue=q) for q in queues]
    scores = QueueScorer().score(request(), eps)
    assert sorted(range(16), key=lambda i: -scores[i]) == sorted(range(16), key=lambda i: queues[i])
