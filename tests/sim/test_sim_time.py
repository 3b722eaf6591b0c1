"""Simulated time: the scaled clock, histogram units, bounded LoRA info, seeded faults."""

from __future__ import annotations

import time
from dataclasses import replace

import aiohttp

from endpoint_picker_sim.clock import ScaledClock
from endpoint_picker_sim.config import FaultConfig
from endpoint_picker_sim.stats import LORA_INFO_SERIES, EngineStats

from .builders import server_config
from .conftest import serving


async def test_scaled_clock_runs_at_time_scale_and_reports_lateness() -> None:
    """At time-scale 10, 0.5 simulated seconds pass in about 50 ms of wall time."""
    clock = ScaledClock(10.0)
    start = time.monotonic()
    error = await clock.sleep_until(0.5)
    wall = time.monotonic() - start
    assert 0.045 < wall < 0.2
    assert -0.002 < error < 0.15
    assert clock.now() >= 0.48


async def test_latency_histograms_are_in_simulated_seconds(http: aiohttp.ClientSession) -> None:
    """At time-scale 50, e2e latency in /metrics is the simulated GPU time, ~50x the wall time."""
    async with serving(server_config(time_scale=50.0)) as sim:
        body = {"prompt": "x", "max_tokens": 100}
        start = time.monotonic()
        async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
        wall = time.monotonic() - start
        e2e = sim.engine.stats.e2e.sum
    # 100 decode steps of ~6.8 ms: ~0.69 s simulated, ~14 ms of wall time.
    assert 0.6 < e2e < 0.8
    assert wall < e2e / 5


def test_lora_info_keeps_only_recent_label_sets() -> None:
    """vllm:lora_requests_info keeps a bounded number of series, refreshing the current one."""
    stats = EngineStats()
    for i in range(LORA_INFO_SERIES + 5):
        stats.set_lora_info(f"a{i}", "", float(i))
    stats.set_lora_info(f"a{LORA_INFO_SERIES + 4}", "", 100.0)
    assert len(stats.lora_info) == LORA_INFO_SERIES
    assert next(reversed(stats.lora_info.items())) == ((f"a{LORA_INFO_SERIES + 4}", ""), 100.0)


async def test_seeded_failures_repeat(http: aiohttp.ClientSession) -> None:
    """The same --seed gives the same sequence of injected failures."""
    faults = FaultConfig(failure_rate=0.5, failure_codes=(429, 503))

    async def statuses() -> list[int]:
        async with serving(replace(server_config(), faults=faults, seed=11)) as sim:
            out = []
            for _ in range(20):
                body = {"prompt": "x", "max_tokens": 1}
                async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
                    out.append(resp.status)
            return out

    first, second = await statuses(), await statuses()
    assert first == second
    assert {200, 429, 503} <= set(first)
