"""Benchmark: the latency predictor's cost on the request path.

Run: ``.venv/bin/python benchmarks/bench_predictor.py`` (a benchmark, not a test).
Prints median microseconds of (1) ``predicted-latency-scorer``'s score over 4 and 16 endpoints
(a 4,000-token prompt whose prefix some endpoints hold: hashing, prefix match, features and two
predictions per endpoint), and (2) one request's lifecycle in the predictor (routed, first
bytes, finished: the two samples it learns from, each into its endpoint's model and the pooled
one).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from endpoint_picker.exchange import Lifecycle
from endpoint_picker.requests import Api, LLMRequest
from endpoint_picker.scheduling.lifecycle import InFlight
from endpoint_picker.scheduling.plugins.predicted import PredictedLatencyScorer, PredictionSource
from endpoint_picker.scheduling.predictor import LatencyPredictor
from endpoint_picker.types import Endpoint, EndpointState, MetricsSnapshot

PROMPT = "".join(f"system prompt sentence {i}. " for i in range(700))  # ~4,000 tokens


def pool(n: int, now: float, rng: random.Random) -> list[EndpointState]:
    return [
        EndpointState(
            Endpoint(f"pod-{i}", "bench", f"10.1.0.{i + 1}", 8000),
            MetricsSnapshot(
                waiting_queue_size=rng.randrange(5),
                running_requests=rng.randrange(64),
                kv_cache_usage=rng.random(),
                updated_at=now,
            ),
        )
        for i in range(n)
    ]


def request(i: int) -> LLMRequest:
    body = {"prompt": PROMPT + f" question {i}?"}
    return LLMRequest(f"r{i}", Api.COMPLETIONS, "m", b"{}", body, target_model="m", stream=True)


def measure(n: int, iterations: int) -> tuple[float, float]:
    rng = random.Random(n)
    now = time.monotonic()
    endpoints = pool(n, now, rng)
    source = PredictionSource(LatencyPredictor(), InFlight())
    scorer = PredictedLatencyScorer(source)
    lifecycle = Lifecycle([source], [source], [source])
    clock = time.perf_counter_ns
    scores: list[int] = []
    events: list[int] = []
    for i in range(iterations):
        req = request(i)
        start = clock()
        result = scorer.score(req, endpoints)
        scores.append(clock() - start)
        chosen = endpoints[max(range(n), key=result.__getitem__)].hostport
        start = clock()
        lifecycle.routed(req, chosen)
        lifecycle.started(req.request_id)
        lifecycle.finished(req.request_id, True, 1.0, 100)
        events.append(clock() - start)
    return statistics.median(scores) / 1e3, statistics.median(events) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5_000)
    parser.add_argument("--sizes", default="4,16", help="pool sizes, comma-separated")
    args = parser.parse_args()
    print(f"{'endpoints':>9}  {'score median us':>15}  {'events median us':>16}")
    for n in (int(s) for s in args.sizes.split(",")):
        score, events = measure(n, args.iterations)
        print(f"{n:>9}  {score:>15.1f}  {events:>16.1f}")


if __name__ == "__main__":
    main()
