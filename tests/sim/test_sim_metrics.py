"""/metrics: vLLM's names, types and labels, parsed back by prometheus_client, under load."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from endpoint_picker_sim.server import SimServer
from endpoint_picker_sim.stats import TTFT_BUCKETS

from .builders import prompt, server_config
from .conftest import serving

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LABELS = {"model_name": MODEL, "engine": "0"}


async def scrape(http: aiohttp.ClientSession, sim: SimServer) -> dict[str, list[Sample]]:
    async with http.get(f"{sim.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: dict[str, list[Sample]], family: str, sample: str | None = None) -> float:
    """The single sample named ``sample`` (default: the family name) of ``family``."""
    (hit,) = [s for s in samples[family] if s.name == (sample or family)]
    return hit.value


async def test_families_types_and_labels(sim: SimServer, http: aiohttp.ClientSession) -> None:
    """Every vLLM family the EPP reads is present with its type, and carries model_name/engine."""
    async with http.post(
        f"{sim.url}/v1/completions", json={"model": "tweet", "prompt": "hi", "max_tokens": 3}
    ) as resp:
        assert resp.status == 200
    async with http.get(f"{sim.url}/metrics") as resp:
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:gpu_cache_usage_perc": "gauge",
        "vllm:lora_requests_info": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "sim:step_lag_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
        assert families[name].documentation, name
        for sample in families[name].samples:
            assert sample.labels["model_name"] == MODEL
            assert sample.labels["engine"] == "0"
    assert text.count("# HELP ") == text.count("# TYPE ") == len(families)
    (cache,) = families["vllm:cache_config_info"].samples
    assert (cache.labels["block_size"], cache.labels["num_gpu_blocks"]) == ("16", "27000")
    lora = families["vllm:lora_requests_info"].samples[-1]
    assert lora.labels["max_lora"] == "2"
    assert {"running_lora_adapters", "waiting_lora_adapters"} <= set(lora.labels)
    assert abs(lora.value - time.time()) < 60  # a wall-clock timestamp
    ttft = families["vllm:time_to_first_token_seconds"].samples
    les = [s.labels["le"] for s in ttft if s.name.endswith("_bucket")]
    assert les == [repr(b) for b in TTFT_BUCKETS] + ["+Inf"]
    count = [s.value for s in ttft if s.name.endswith("_count")]
    assert count == [1.0]
    gen = families["vllm:generation_tokens"].samples
    assert [(s.name, s.value) for s in gen] == [("vllm:generation_tokens_total", 3.0)]


async def test_burst_of_long_prompts_raises_waiting_and_kv_usage(
    http: aiohttp.ClientSession,
) -> None:
    """A burst of long prompts shows as num_requests_waiting > 0 and KV usage > 0, then drains."""
    async with serving(server_config(time_scale=5.0, num_gpu_blocks=4000)) as sim:
        body = {"model": MODEL, "max_tokens": 20}
        tasks = [
            asyncio.create_task(
                http.post(
                    f"{sim.url}/v1/completions", json={**body, "prompt": prompt(6000, str(i))}
                )
            )
            for i in range(12)
        ]
        peak_waiting = peak_usage = 0.0
        while not all(t.done() for t in tasks):
            m = await scrape(http, sim)
            peak_waiting = max(peak_waiting, value(m, "vllm:num_requests_waiting"))
            peak_usage = max(peak_usage, value(m, "vllm:kv_cache_usage_perc"))
            await asyncio.sleep(0.01)
        for t in tasks:
            (await t).release()
        m = await scrape(http, sim)
    assert peak_waiting >= 5
    assert peak_usage > 0.3
    assert value(m, "vllm:num_requests_waiting") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == 0
    assert value(m, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 12 * 6000


async def test_preemptions_show_in_metrics(http: aiohttp.ClientSession) -> None:
    """Under KV pressure vllm:num_preemptions_total increases and all requests still finish."""
    async with serving(server_config(time_scale=50.0, num_gpu_blocks=128)) as sim:
        body = {"model": MODEL, "max_tokens": 400}

        async def one(i: int) -> int:
            payload = {**body, "prompt": prompt(300, str(i))}
            async with http.post(f"{sim.url}/v1/completions", json=payload) as resp:
                return int((await resp.json())["usage"]["completion_tokens"])

        done = await asyncio.gather(*(one(i) for i in range(5)))
        m = await scrape(http, sim)
    assert done == [400] * 5
    assert value(m, "vllm:num_preemptions", "vllm:num_preemptions_total") > 0


async def test_second_identical_prompt_is_served_faster(http: aiohttp.ClientSession) -> None:
    """Over HTTP, the repeat of an 8,000-token prompt reaches its first token much sooner."""
    async with serving(server_config(time_scale=2.0)) as sim:
        body = {"model": MODEL, "prompt": prompt(8000), "max_tokens": 1, "stream": True}

        async def ttft() -> float:
            start = time.monotonic()
            async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
                await resp.content.readline()
                elapsed = time.monotonic() - start
                await resp.read()
            return elapsed

        first, second = await ttft(), await ttft()
        m = await scrape(http, sim)
    assert second < first / 3
    assert value(m, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") >= 7984


def _blocks(text: str) -> set[str]:
    """The families of an exposition, each from its ``# HELP`` line (prometheus_client's
    restricted registry renders them in no fixed order)."""
    return {"# HELP " + block for block in text.split("# HELP ") if block}


def test_restrict_matches_prometheus_client() -> None:
    """The simulator's ``name[]`` filter gives what prometheus_client's restricted registry
    gives for the same families: gauges, a counter's ``_total`` and a histogram's samples."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from endpoint_picker_sim.metrics import restrict

    registry = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "Waiting.", ["model_name"], registry=registry).labels(
        MODEL
    ).set(3)
    Gauge("vllm:num_requests_running", "Running.", registry=registry).set(5)
    Counter("vllm:prompt_tokens", "Prompt tokens.", registry=registry).inc(7)
    Histogram("vllm:e2e", "E2E.", buckets=(0.5, 1.0), registry=registry).observe(0.7)
    whole = generate_latest(registry).decode()
    for names in (
        ["vllm:num_requests_waiting"],
        ["vllm:num_requests_waiting", "vllm:prompt_tokens_total", "vllm:e2e_bucket"],
        ["vllm:e2e", "vllm:e2e_count", "vllm:nothing"],
        [],
    ):
        expected = generate_latest(registry.restricted_registry(names)).decode()
        assert _blocks(restrict(whole, names)) == _blocks(expected), names


async def test_metrics_honour_the_name_filter(sim: SimServer, http: aiohttp.ClientSession) -> None:
    """``/metrics?name[]=...`` (what the EPP asks) returns those families only, as vLLM does."""
    query = "name%5B%5D=vllm%3Anum_requests_waiting&name%5B%5D=vllm%3Acache_config_info"
    async with http.get(f"{sim.url}/metrics?{query}") as resp:
        assert resp.status == 200
        text = await resp.text()
    families = {f.name for f in text_string_to_metric_families(text)}
    assert families == {"vllm:num_requests_waiting", "vllm:cache_config_info"}
    whole = await scrape(http, sim)
    assert len(whole) > 10
