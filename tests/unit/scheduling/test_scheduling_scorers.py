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
        ([], [], 0, 0.0),  # reports LoRA info with no slots
        ([], [], None, 0.7),  # no LoRA info yet: below a known free slot, above waiting
    ],
)
def test_lora_affinity_precedence(
    active: list[str], waiting: list[str], max_lora: int | None, expected: float
) -> None:
    """LoRA affinity: running 1.0, else free slot 0.8, else unknown 0.7, waiting 0.6, else 0."""
    ep = endpoint(active=active, waiting=waiting, max_lora=max_lora)
    assert LoraAffinityScorer().score(request("a"), [ep]) == [expected]


def test_base_model_request_is_not_steered_by_lora_state() -> None:
    """A request for the base model scores every endpoint alike, a pod without LoRA info too."""
    eps = [
        endpoint(active=["x"], max_lora=2, base=["llama"]),  # a free slot
        endpoint(active=["x", "y"], max_lora=2, base=["llama"]),  # full
        endpoint(max_lora=None, base=["llama"]),  # fresh: no LoRA info sample yet
        endpoint(max_lora=None, age=None),  # never scraped: no base model known
    ]
    assert LoraAffinityScorer().score(request("llama"), eps) == [1.0] * 4


def test_adapter_named_like_a_base_model_is_still_an_adapter() -> None:
    """A target that some candidate runs as an adapter is scored as an adapter request."""
    eps = [
        endpoint(active=["llama"], max_lora=2, base=["llama"]),
        endpoint(active=["x", "y"], max_lora=2, base=["llama"]),
    ]
    assert LoraAffinityScorer().score(request("llama"), eps) == [1.0, 0.0]


def test_unknown_target_without_base_model_info_keeps_adapter_scoring() -> None:
    """With no base model reported anywhere, a target is scored as an adapter (as before)."""
    eps = [endpoint(active=["a"], max_lora=2), endpoint(max_lora=None)]
    assert LoraAffinityScorer().score(request("a"), eps) == [1.0, 0.7]


def test_scorers_keep_endpoint_order() -> None:
    """Scores align with the endpoints they were given, whatever their order."""
    rng = random.Random(7)
    queues = [rng.randrange(20) for _ in range(16)]
    eps = [endpoint(queue=q) for q in queues]
    scores = QueueScorer().score(request(), eps)
    assert sorted(range(16), key=lambda i: -scores[i]) == sorted(range(16), key=lambda i: queues[i])
