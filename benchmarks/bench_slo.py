"""Benchmark: what the latency objective costs on the request path.

Run: ``.venv/bin/python benchmarks/bench_slo.py`` (a benchmark, not a test).
Every endpoint's windows are full (``maxSamples`` samples of the objective model, so the pool
and endpoint fits hold as many), as under steady load. Prints median microseconds per call of:
``slo-aware-scorer`` for a request with an objective and one without; ``slo-saturation-detector``
in its worst case (no endpoint meets the objective, so every candidate is predicted); and one
request's lifecycle in the tracker (routed + finished, a sample inserted into three windows).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from endpoint_picker.requests import Api, LLMRequest
from endpoint_picker.scheduling.latency import LatencyTracker
from endpoint_picker.scheduling.lifecycle import Finished, Routed
from endpoint_picker.scheduling.plugins.slo import SloAwareScorer, SloSaturationDetector
from endpoint_picker.scheduling.saturation import UtilizationDetector
from endpoint_picker.types import Endpoint, EndpointState, MetricsSnapshot

OBJECTIVE = 0.005  # tighter than every sample below: the detector scans every endpoint


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(request_id: str, objective: float | None) -> LLMRequest:
    return LLMRequest(
        request_id=request_id, api=Api.COMPLETIONS, model="crit", raw_body=b"{}", body={},
        target_model="crit", latency_objective=objective,
    )  # fmt: skip


def fill(tracker: LatencyTracker, hostports: list[str], samples: int, clock: Clock) -> None:
    rng = random.Random(1)
    for i in range(samples):
        for hostport in hostports:
            rid = f"{hostport}-{i}"
            tracker.on_routed(Routed(request(rid, OBJECTIVE), hostport))
            tracker.on_finished(Finished(rid, True, (0.01 + 0.01 * rng.random()) * 100, 100))
        clock.now += 0.001


def median_us(call: Callable[[], object], iterations: int) -> float:
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(n: int, samples: int, iterations: int) -> dict[str, float]:
    clock = Clock()
    hostports = [f"10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(n)]
    fresh = MetricsSnapshot(updated_at=clock.now + 3600)
    endpoints = [
        EndpointState(Endpoint(f"p{i}", "ns", h.split(":")[0], 8000), fresh)
        for i, h in enumerate(hostports)
    ]
    tracker = LatencyTracker(clock, max_samples=samples)
    fill(tracker, hostports, samples, clock)
    scorer = SloAwareScorer(tracker)
    detector = SloSaturationDetector(
        tracker, UtilizationDetector(queue_depth_threshold=1e9, clock=clock)
    )
    assert detector.is_saturated(endpoints), "the worst case scans every endpoint"
    with_objective, best_effort = request("x", OBJECTIVE), request("y", None)
    counter = iter(range(10**9))

    def lifecycle() -> None:
        rid = f"life-{next(counter)}"
        tracker.on_routed(Routed(request(rid, OBJECTIVE), hostports[0]))
        tracker.on_finished(Finished(rid, True, 1.5, 100))

    return {
        "score, objective": median_us(lambda: scorer.score(with_objective, endpoints), iterations),
        "score, best effort": median_us(lambda: scorer.score(best_effort, endpoints), iterations),
        "detector, worst case": median_us(lambda: detector.is_saturated(endpoints), iterations),
        "routed + finished": median_us(lifecycle, iterations),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--samples", type=int, default=512, help="maxSamples, all filled")
    args = parser.parse_args()
    for n in (16, 256):
        results = measure(n, args.samples, args.iterations)
        cells = ", ".join(f"{name} {us:.1f}" for name, us in results.items())
        print(f"{n:>4} endpoints, {args.samples} samples each (median us): {cells}")


if __name__ == "__main__":
    main()
