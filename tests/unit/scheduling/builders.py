"""Tiny builders for scheduling tests: endpoints, requests, a fake clock, a built scheduler."""

from __future__ import annotations

import random
from collections.abc import Sequence

from endpoint_picker.requests import Api, LLMRequest
from endpoint_picker.scheduling import SchedulingComponents, build_scheduling, load_config
from endpoint_picker.settings import SchedulingSettings
from endpoint_picker.types import Endpoint, EndpointState, MetricsSnapshot

NOW = 1000.0  # the fake clock's time, in monotonic seconds


def clock() -> float:
    return NOW


_counter = iter(range(1, 1_000_000))


def endpoint(
    name: str | None = None,
    *,
    queue: int = 0,
    running: int = 0,
    kv: float = 0.0,
    active: Sequence[str] = (),
    waiting: Sequence[str] = (),
    max_lora: int | None = 0,
    base: Sequence[str] = (),
    age: float | None = 0.0,
) -> EndpointState:
    """One endpoint; ``age`` is how old its metrics are at ``NOW`` (None: never scraped).

    ``max_lora=None``: no LoRA info reported; ``base``: the base models its metrics name.
    """
    n = next(_counter)
    return EndpointState(
        Endpoint(name or f"pod-{n}", "ns", f"10.0.{n // 250}.{n % 250 + 1}", 8000),
        MetricsSnapshot(
            waiting_queue_size=queue,
            running_requests=running,
            kv_cache_usage=kv,
            active_adapters=frozenset(active),
            waiting_adapters=frozenset(waiting),
            max_active_adapters=max_lora,
            base_models=frozenset(base),
            updated_at=0.0 if age is None else NOW - age,
        ),
    )


def request(target: str = "base-model") -> LLMRequest:
    return LLMRequest(
        request_id="req-1",
        api=Api.COMPLETIONS,
        model=target,
        raw_body=b"{}",
        body={},
        target_model=target,
    )


def build(
    yaml_text: str | None = None, *, fallbacks: int = 0, seed: int = 0
) -> SchedulingComponents:
    config = None if yaml_text is None else load_config(yaml_text)
    return build_scheduling(
        config,
        settings=SchedulingSettings(max_fallback_endpoints=fallbacks),
        staleness_threshold=2.0,
        clock=clock,
        rng=random.Random(seed),
    )


HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
