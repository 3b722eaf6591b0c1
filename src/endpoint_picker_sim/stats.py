"""Counters and histograms the engine updates on its hot path; ``metrics`` renders them.

Plain attributes instead of prometheus_client objects: the engine updates them hundreds of times
per step, and one process hosts many engines, so an update must cost a few attribute writes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass, field

# vLLM v1 buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
STEP_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)

# How many recent label combinations of vllm:lora_requests_info to keep exposed.
LORA_INFO_SERIES = 8


class Histogram:
    """Prometheus histogram state: per-bucket (non-cumulative) counts, sum and count."""

    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        # One slot per finite bucket plus +Inf.
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """Record ``n`` observations of ``value`` (le is inclusive, as in Prometheus)."""
        self.counts[bisect_left(self.buckets, value)] += n
        self.sum += value * n
        self.count += n


@dataclass(slots=True)
class EngineStats:
    """Everything /metrics reports that is not read live from the scheduler."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    # Tokens the longest prefix cached anywhere in the fleet would have hit (the oracle).
    oracle_hits: int = 0
    success_length: int = 0
    success_abort: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    # The simulator's own health: how late the step loop runs against its plan (wall seconds).
    steps: int = 0
    step_lag: Histogram = field(default_factory=lambda: Histogram(STEP_LAG_BUCKETS))
    step_planned_wall: float = 0.0
    step_late_wall: float = 0.0
    # Wake-ups come early by up to the timer granularity: the clock centres them on the plan.
    step_early_wall: float = 0.0
    step_behind_wall: float = 0.0
    # (running adapters, waiting adapters) -> wall-clock time of the last update, oldest first.
    lora_info: OrderedDict[tuple[str, str], float] = field(default_factory=OrderedDict)

    def set_lora_info(self, running: str, waiting: str, wall_time: float) -> None:
        """Stamp the current adapter sets, keeping the most recent few combinations."""
        key = (running, waiting)
        info = self.lora_info
        if key in info:
            info.move_to_end(key)
        elif len(info) >= LORA_INFO_SERIES:
            info.popitem(last=False)
        info[key] = wall_time
