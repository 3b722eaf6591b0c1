"""Benchmark: one full default scheduling cycle over 16 and 256 endpoints (``--sizes``).

Run: ``.venv/bin/python benchmarks/bench_scheduling.py`` (a benchmark, not a test).
Prints median and p99 microseconds per ``Scheduler.schedule`` call (metrics fresh, debug logs
off, no observer unless ``--observer``, no record sink unless ``--record``: the status page's
ring of recent decisions, as ``epp serve`` has it), and the median of a worst-case saturation
check (every endpoint saturated, so all are scanned).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from endpoint_picker.requests import Api, LLMRequest
from endpoint_picker.scheduling import build_scheduling, load_config
from endpoint_picker.settings import SchedulingSettings
from endpoint_picker.types import Endpoint, EndpointState, MetricsSnapshot


class NullObserver:
    """Receives timings and drops them: measures the cost of timing itself."""

    def plugin_duration(
        self, extension_point: str, plugin_type: str, plugin_name: str, seconds: float
    ) -> None:
        return None

    def scheduler_duration(self, seconds: float) -> None:
        return None


def make_pool(n: int, rng: random.Random, now: float) -> list[EndpointState]:
    adapters = [f"lora-{i}" for i in range(8)]
    return [
        EndpointState(
            Endpoint(f"pod-{i}", "bench", f"10.1.{i // 250}.{i % 250 + 1}", 8000),
            MetricsSnapshot(
                waiting_queue_size=rng.randrange(10),
                running_requests=rng.randrange(64),
                kv_cache_usage=rng.random(),
                active_adapters=frozenset(rng.sample(adapters, 2)),
                waiting_adapters=frozenset(rng.sample(adapters, 1)),
                max_active_adapters=4,
                updated_at=now - rng.random() * 0.1,
            ),
        )
        for i in range(n)
    ]


def measure(
    n: int,
    iterations: int,
    fallbacks: int,
    observer: bool,
    record: bool = False,
    config: str | None = None,
    prompt_chars: int = 0,
) -> tuple[float, float, float]:
    """Median and p99 of schedule(), and median of is_saturated(), in microseconds."""
    rng = random.Random(n)
    now = time.monotonic()
    pool = make_pool(n, rng, now)
    extra: dict[str, Any] = {}
    if record:  # the sink epp serve gives the scheduler: the status page's recent decisions
        from endpoint_picker.status.decisions import DecisionLog

        extra["record"] = DecisionLog().record
    parts = build_scheduling(
        load_config(Path(config).read_text(encoding="utf-8")) if config else None,
        settings=SchedulingSettings(max_fallback_endpoints=fallbacks),
        staleness_threshold=2.0,
        clock=lambda: now,  # frozen, so the metrics stay fresh however long the run takes
        rng=random.Random(1),
        observer=NullObserver() if observer else None,
        **extra,
    )
    body = {"prompt": "".join(rng.choice("abcdefgh ") for _ in range(prompt_chars))}
    request = LLMRequest("bench", Api.COMPLETIONS, "lora-3", b"{}", body, target_model="lora-3")
    schedule, detect = parts.scheduler.schedule, parts.saturation_detector.is_saturated
    clock = time.perf_counter_ns
    # With a prompt, each cycle is a new request (its prompt hashed once, as in serving);
    # without, one request again and again.
    requests = [
        replace(request, request_id=f"bench-{i}") if prompt_chars else request
        for i in range(iterations)
    ]
    for r in requests[: iterations // 10]:  # warm up
        schedule(r, pool)
    samples: list[int] = []
    for r in requests:
        start = clock()
        schedule(r, pool)
        samples.append(clock() - start)
    busy = [EndpointState(e.endpoint, replace(e.metrics, waiting_queue_size=50)) for e in pool]
    sat: list[int] = []
    for _ in range(iterations):
        start = clock()
        detect(busy)
        sat.append(clock() - start)
    samples.sort()
    p99 = samples[int(len(samples) * 0.99) - 1]
    return statistics.median(samples) / 1e3, p99 / 1e3, statistics.median(sat) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--fallbacks", type=int, default=0, help="max fallback endpoints")
    parser.add_argument("--observer", action="store_true", help="time every plugin")
    parser.add_argument("--record", action="store_true", help="keep recent decisions")
    parser.add_argument("--sizes", default="16,256", help="pool sizes, comma-separated")
    parser.add_argument("--config", help="a scheduler config file (default: the default's)")
    parser.add_argument("--prompt-chars", type=int, default=0, help="the request's prompt size")
    args = parser.parse_args()
    # Production logs at info: the debug branch must cost nothing.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    print(
        f"{args.config or 'default profile'}, fallbacks={args.fallbacks}, "
        f"observer={args.observer}, record={args.record}, prompt {args.prompt_chars} chars, "
        f"{args.iterations} cycles"
    )
    print(f"{'endpoints':>9}  {'median us':>9}  {'p99 us':>7}  {'saturation (worst) us':>21}")
    for n in (int(size) for size in args.sizes.split(",")):
        median, p99, sat = measure(
            n, args.iterations, args.fallbacks, args.observer, args.record, args.config,
            args.prompt_chars,
        )  # fmt: skip
        print(f"{n:>9}  {median:>9.1f}  {p99:>7.1f}  {sat:>21.2f}")


if __name__ == "__main__":
    main()
