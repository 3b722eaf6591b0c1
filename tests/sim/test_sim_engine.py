"""Engine behaviour a vLLM user recognises, driven step by step on a manual clock."""

from __future__ import annotations

import asyncio

import pytest

from endpoint_picker_sim.clock import ScaledClock
from endpoint_picker_sim.config import PROFILES, EngineConfig
from endpoint_picker_sim.engine import Engine

from .builders import engine, prompt, request, run


def ttft(req_arrival: float, first: float | None) -> float:
    assert first is not None
    return first - req_arrival


def test_repeated_prompt_hits_the_prefix_cache_and_its_ttft_drops() -> None:
    """The second time a 4,000-token prompt arrives its TTFT is a fraction of the first."""
    eng, clock = engine()
    text = prompt(4000)
    first = request(text)
    eng.add(first)
    run(eng, clock)
    second = request(text)
    eng.add(second)
    run(eng, clock)
    t1 = ttft(first.arrival, first.first_token_at)
    t2 = ttft(second.arrival, second.first_token_at)
    assert t2 < t1 / 5
    assert eng.stats.prefix_hits >= 3968  # every full block but the one holding the last token
    assert eng.stats.prefix_queries == 8000


def test_prefix_cache_is_per_adapter() -> None:
    """The same prompt under a LoRA adapter does not reuse the base model's blocks."""
    eng, clock = engine()
    text = prompt(1000)
    eng.add(request(text))
    run(eng, clock)
    eng.add(request(text, lora="sql-lora"))
    run(eng, clock)
    assert eng.stats.prefix_hits == 0


def test_long_prompts_queue_behind_the_token_budget() -> None:
    """Ten 6,000-token prompts against an 8,192-token budget: most wait, and drain over time."""
    eng, clock = engine()
    for i in range(10):
        eng.add(request(prompt(6000, seed=str(i))))
    run(eng, clock, steps=1)
    assert len(eng.waiting) >= 8
    run(eng, clock)
    assert eng.idle
    assert eng.stats.success_length == 10


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    """A 20,000-token prompt with an 8,192-token budget needs three steps to its first token."""
    eng, clock = engine()
    req = request(prompt(20_000))
    eng.add(req)
    assert run(eng, clock, steps=2) == 2
    assert req.first_token_at is None
    run(eng, clock, steps=1)
    assert req.generated == 1


def test_max_num_seqs_caps_the_running_set() -> None:
    """No more than max_num_seqs requests run at once; the rest wait."""
    eng, clock = engine(max_num_seqs=4)
    for i in range(10):
        eng.add(request(prompt(10, seed=str(i))))
    run(eng, clock, steps=1)
    assert len(eng.running) == 4
    assert len(eng.waiting) == 6


def test_kv_usage_rises_with_context_and_drops_when_requests_finish() -> None:
    """Usage grows while requests decode and returns to zero once they finish."""
    eng, clock = engine(num_gpu_blocks=1000)
    for i in range(4):
        eng.add(request(prompt(500, seed=str(i)), max_tokens=200))
    run(eng, clock, steps=2)
    early = eng.blocks.usage()
    run(eng, clock, steps=150)
    later = eng.blocks.usage()
    assert 0 < early < later
    run(eng, clock)
    assert eng.blocks.usage() == 0.0
    assert eng.blocks.num_cached > 0  # ...yet the prompts stay cached


def test_kv_pressure_preempts_the_newest_request_and_everything_still_finishes() -> None:
    """When blocks run out the newest running request is preempted, recomputed, and finishes."""
    eng, clock = engine(num_gpu_blocks=64)  # 1,024 tokens
    reqs = [request(prompt(200, seed=str(i)), max_tokens=300) for i in range(4)]
    for r in reqs:
        eng.add(r)
    run(eng, clock)
    assert eng.stats.preemptions > 0
    assert all(r.generated == 300 for r in reqs)
    assert eng.stats.generation_tokens == 1200
    assert eng.blocks.usage() == 0.0


def test_a_third_adapter_waits_while_two_are_in_the_batch() -> None:
    """With max_loras=2, a request for a third adapter waits until a slot frees up."""
    eng, clock = engine(max_loras=2)
    a = request(prompt(50), max_tokens=50, lora="a")
    b = request(prompt(50), max_tokens=50, lora="b")
    c = request(prompt(50), max_tokens=5, lora="c")
    base = request(prompt(50, seed="q"), max_tokens=5)
    for r in (a, b, c, base):
        eng.add(r)
    run(eng, clock, steps=1)
    assert {r.lora for r in eng.running} == {"a", "b", None}
    assert list(eng.waiting) == [c]
    running, waiting = next(reversed(eng.stats.lora_info))
    assert (running, waiting) == ("a,b", "c")
    run(eng, clock, until=lambda: c.generated > 0)
    assert a.finished
    assert b.finished
    assert eng.stats.lora_info  # the info gauge kept a bounded history of label sets


def test_adapter_load_costs_time_once() -> None:
    """Bringing an adapter into a LoRA slot adds lora_load_ms to that step only."""
    eng, _ = engine(lora_load_ms=40.0)
    eng.add(request(prompt(10), lora="a"))
    _, first = eng.step()
    eng2, _ = engine(lora_load_ms=40.0)
    eng2.add(request(prompt(10)))
    _, base = eng2.step()
    assert first - base == pytest.approx(0.040)


def test_step_time_follows_the_profile() -> None:
    """A decode step of two requests costs 1150 + 5680 + 0.076 x context + 4.4 x 2 us."""
    eng, clock = engine()
    eng.add(request(prompt(100, "a"), max_tokens=10))
    eng.add(request(prompt(300, "b"), max_tokens=10))
    run(eng, clock, steps=1)  # prefill both
    _, duration = eng.step()
    expected = 1150 + 5680 + 0.076 * (101 + 301) + 4.4 * 2
    assert duration == pytest.approx(expected * 1e-6)
    assert PROFILES["llama-3.1-8b-h100"].num_gpu_blocks == 27000


def test_a_half_speed_engine_takes_twice_as_long_for_the_same_request() -> None:
    """speed=0.5 doubles every step: the same request's TTFT (prefill) and decode time double."""
    times = []
    for speed in (1.0, 0.5):
        eng, clock = engine(speed=speed)
        req = request(prompt(2000), max_tokens=32)
        eng.add(req)
        run(eng, clock)
        assert req.finished
        assert req.first_token_at is not None
        times.append((req.first_token_at - req.arrival, clock.t - req.first_token_at))
    (ttft_fast, decode_fast), (ttft_slow, decode_slow) = times
    assert ttft_fast > 0
    assert decode_fast > 0
    assert ttft_slow == pytest.approx(2 * ttft_fast)
    assert decode_slow == pytest.approx(2 * decode_fast)


def test_latency_histograms_record_every_token() -> None:
    """TTFT once per request, ITL once per later token, e2e once per request."""
    eng, clock = engine()
    for i in range(3):
        eng.add(request(prompt(64, str(i)), max_tokens=8))
    run(eng, clock)
    s = eng.stats
    assert (s.ttft.count, s.itl.count, s.e2e.count) == (3, 21, 3)
    assert s.generation_tokens == 24
    assert s.prompt_tokens == 192


def test_abort_frees_blocks() -> None:
    """An aborted request leaves the batch and gives its blocks back."""
    eng, clock = engine()
    req = request(prompt(1000), max_tokens=100)
    eng.add(req)
    run(eng, clock, steps=3)
    assert eng.blocks.usage() > 0
    eng.abort(req)
    assert eng.idle
    assert eng.blocks.usage() == 0.0
    assert req.finish_reason == "abort"


async def test_idle_loop_waits_instead_of_spinning() -> None:
    """With nothing to do the step loop sleeps on an event: no steps, no CPU."""
    eng = Engine(EngineConfig(time_scale=100.0), ScaledClock(100.0))
    task = asyncio.create_task(eng.run())
    await asyncio.sleep(0.05)
    assert eng.stats.steps == 0
    req = request(prompt(100), max_tokens=5)
    eng.add(req)
    await asyncio.wait_for(req.tokens(5), timeout=5)
    steps = eng.stats.steps
    await asyncio.sleep(0.05)
    assert eng.stats.steps == steps
    assert eng.stats.step_planned_wall > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
