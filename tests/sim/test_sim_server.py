"""The OpenAI surface over real HTTP, as vLLM serves it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
import pytest

from endpoint_picker_sim.config import FaultConfig
from endpoint_picker_sim.request import SimRequest
from endpoint_picker_sim.server import SimServer
from endpoint_picker_sim.tokenizer import count_tokens

from .builders import prompt, server_config
from .conftest import serving

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if raw[:1] == b"{" else raw.decode()


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, str]]:
    """Yield (arrival time, data) per server-sent event."""
    async for line in resp.content:
        if line.startswith(b"data: "):
            yield time.monotonic(), line[6:].decode().strip()


async def test_completion_honours_max_tokens_and_reports_usage(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    """A completion returns text of max_tokens tokens and matching usage."""
    status, body = await post(
        http, f"{sim.url}/v1/completions", {"model": MODEL, "prompt": "abcd" * 25, "max_tokens": 9}
    )
    assert status == 200
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert count_tokens(choice["text"]) == 9
    assert body["usage"] == {"prompt_tokens": 25, "completion_tokens": 9, "total_tokens": 34}


async def test_completion_defaults_to_16_tokens_and_chat_to_128(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    """Without max_tokens, completions generate 16 tokens (vLLM's default) and chat 128."""
    _, body = await post(http, f"{sim.url}/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert body["usage"]["completion_tokens"] == 16
    msgs = [{"role": "user", "content": "hi"}]
    _, body = await post(http, f"{sim.url}/v1/chat/completions", {"model": MODEL, "messages": msgs})
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 128


async def test_unknown_model_is_404_with_vllm_body(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    """A model that is neither the base nor a known adapter gets vLLM's NotFoundError."""
    status, body = await post(http, f"{sim.url}/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404
    assert body == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }


async def test_bad_requests_are_400(sim: SimServer, http: aiohttp.ClientSession) -> None:
    """Bad JSON, a missing or empty prompt, missing messages, too long a context are 400s."""
    async with http.post(f"{sim.url}/v1/completions", data=b"{not json") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "BadRequestError"
    status, body = await post(http, f"{sim.url}/v1/completions", {"model": MODEL})
    assert (status, body["error"]["code"]) == (400, 400)
    status, _ = await post(http, f"{sim.url}/v1/chat/completions", {"model": MODEL})
    assert status == 400
    status, _ = await post(http, f"{sim.url}/v1/completions", {"prompt": "", "max_tokens": 0})
    assert status == 400
    huge = {"model": MODEL, "prompt": "x", "max_tokens": 10**7}
    status, body = await post(http, f"{sim.url}/v1/completions", huge)
    assert status == 400
    assert "maximum context length" in body["error"]["message"]


async def test_chunked_request_body_is_accepted(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    """A body sent with Transfer-Encoding: chunked is read whole."""
    payload = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2})

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 7):
            yield payload[i : i + 7]

    async with http.post(f"{sim.url}/v1/completions", data=chunks()) as resp:
        assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
        assert resp.status == 200
        assert (await resp.json())["usage"]["completion_tokens"] == 2


async def test_streaming_chunks_are_spread_over_time() -> None:
    """At real-time speed, 30 streamed tokens arrive one step apart, not all at the end."""
    async with (
        serving(server_config(time_scale=1.0)) as sim,
        aiohttp.ClientSession() as http,
    ):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 30, "stream": True}
        async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = [e async for e in sse_events(resp)]
    times = [t for t, data in events if data != "[DONE]"]
    assert len(times) == 30
    # ~6.8 ms per decode step: the stream spans ~200 ms and most chunks come well before the end
    # (tolerant of a stall or two on a busy machine, which the engine catches up on).
    span = times[-1] - times[0]
    assert span > 0.1
    assert sum(1 for t in times if t < times[-1] - span / 2) >= 10


async def test_stream_interval_usage_chunk_and_done(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    """With stream_interval 4, 10 tokens come as 1+4+4+1; usage is a last chunk; then [DONE]."""
    async with serving(replace(server_config(), stream_interval=4)) as sim4:
        body = {
            "model": "sql-lora",
            "prompt": "hi",
            "max_tokens": 10,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.post(f"{sim4.url}/v1/completions", json=body) as resp:
            events = [data async for _, data in sse_events(resp)]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 10
    sizes = [count_tokens(c["choices"][0]["text"]) for c in chunks]
    assert sizes == [1, 4, 4, 1]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all(c["model"] == "sql-lora" for c in chunks)


async def test_chat_stream_starts_with_the_role(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    """A chat stream opens with the assistant role delta, then content deltas."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 3, "stream": True}
    async with http.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
        events = [data async for _, data in sse_events(resp)]
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:]).count(" ") == 3


async def test_models_and_runtime_lora_management(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    """/v1/models lists base and adapters with parents; adapters load and unload at runtime."""
    async with http.get(f"{sim.url}/v1/models") as resp:
        cards = (await resp.json())["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [
        (MODEL, None),
        ("sql-lora", MODEL),
        ("tweet", MODEL),
    ]
    load = {"lora_name": "new", "lora_path": "/adapters/new"}
    status, text = await post(http, f"{sim.url}/v1/load_lora_adapter", load)
    assert (status, text) == (200, "Success: LoRA adapter 'new' added successfully.")
    status, body = await post(http, f"{sim.url}/v1/load_lora_adapter", load)
    assert status == 400
    assert "already been loaded" in body["error"]["message"]
    status, _ = await post(http, f"{sim.url}/v1/completions", {"model": "new", "prompt": "x"})
    assert status == 200
    status, text = await post(http, f"{sim.url}/v1/unload_lora_adapter", {"lora_name": "new"})
    assert (status, text) == (200, "Success: LoRA adapter 'new' removed successfully.")
    status, body = await post(http, f"{sim.url}/v1/unload_lora_adapter", {"lora_name": "new"})
    assert (status, body["error"]["type"]) == (404, "NotFoundError")
    status, _ = await post(http, f"{sim.url}/v1/completions", {"model": "new", "prompt": "x"})
    assert status == 404
    status, _ = await post(http, f"{sim.url}/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400


async def test_health_is_200_with_empty_body(sim: SimServer, http: aiohttp.ClientSession) -> None:
    """GET /health answers 200 and nothing else."""
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200
        assert await resp.read() == b""


async def test_failure_injection(http: aiohttp.ClientSession) -> None:
    """failure_rate 1 answers every generation with a configured code; metrics can fail too."""
    faults = FaultConfig(failure_rate=1.0, failure_codes=(429,), metrics_failure_rate=1.0)
    async with serving(replace(server_config(), faults=faults)) as sim:
        status, body = await post(http, f"{sim.url}/v1/completions", {"prompt": "x"})
        assert (status, body["error"]["code"]) == (429, 429)
        async with http.get(f"{sim.url}/metrics") as resp:
            assert resp.status == 500
        async with http.get(f"{sim.url}/health") as resp:
            assert resp.status == 200


async def test_metrics_delay(http: aiohttp.ClientSession) -> None:
    """metrics_delay_ms holds /metrics back by that long."""
    async with serving(replace(server_config(), faults=FaultConfig(metrics_delay_ms=80))) as sim:
        start = time.monotonic()
        async with http.get(f"{sim.url}/metrics") as resp:
            assert resp.status == 200
        assert time.monotonic() - start >= 0.08


async def test_client_disconnect_mid_stream_frees_the_request(http: aiohttp.ClientSession) -> None:
    """A client that leaves mid-stream stops occupying the batch and the KV cache."""
    async with serving(server_config(time_scale=1.0)) as sim:
        body = {"model": MODEL, "prompt": prompt(500), "max_tokens": 1000, "stream": True}
        async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
            await resp.content.readline()
            assert len(sim.engine.running) == 1
        for _ in range(100):
            if sim.engine.idle:
                break
            await asyncio.sleep(0.01)
        assert sim.engine.idle
        assert sim.engine.blocks.usage() == 0.0


async def test_a_crashed_engine_fails_requests_instead_of_hanging(
    sim: SimServer, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """If the engine task dies, in-flight and new requests get errors, and the crash is logged."""

    def boom() -> tuple[list[tuple[SimRequest, int]], float]:
        raise RuntimeError("boom")

    sim.engine.step = boom  # type: ignore[method-assign]
    status, body = await post(http, f"{sim.url}/v1/completions", {"prompt": "x"})
    assert status == 503  # aborted when the engine died
    status, body = await post(http, f"{sim.url}/v1/completions", {"prompt": "x"})
    assert (status, body["error"]["message"]) == (500, "The engine is not running.")
    assert "engine task" in caplog.text


async def test_next_chat_turn_hits_the_cached_reply(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    """A conversation's second turn reuses the first turn's prompt *and* reply blocks."""
    url = f"{sim.url}/v1/chat/completions"
    turn1 = [
        {"role": "system", "content": "You are terse. " * 40},
        {"role": "user", "content": "Hi"},
    ]
    _, first = await post(http, url, {"messages": turn1, "max_tokens": 64})
    prompt1 = first["usage"]["prompt_tokens"]
    reply = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "More"}]
    hits_before = sim.engine.stats.prefix_hits
    await post(http, url, {"messages": turn2, "max_tokens": 1})
    hits = sim.engine.stats.prefix_hits - hits_before
    # The prompt's blocks, then the reply's (the last block of the KV holds no sampled token).
    assert hits >= (prompt1 + 64 - 1) // 16 * 16 - 16
    assert hits > prompt1


async def test_chat_stream_role_comes_with_the_first_token(http: aiohttp.ClientSession) -> None:
    """As in vLLM, the role delta is sent with the first output, after the prefill: a stream's
    first body bytes mean the request left the waiting queue (the EPP counts on that)."""
    msgs = [{"role": "user", "content": "tell me more " * 1500}]  # about 4,500 tokens
    body = {"model": MODEL, "messages": msgs, "max_tokens": 2, "stream": True}
    async with serving(server_config(time_scale=1.0)) as sim:
        sent = time.monotonic()
        async with http.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
            events = [(at - sent, data) async for at, data in sse_events(resp)]
    role_at, role = events[0]
    assert orjson.loads(role)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert orjson.loads(events[1][1])["choices"][0]["delta"]["content"]
    assert role_at >= 0.05  # a prefill of thousands of tokens takes tens of milliseconds


async def test_chat_stream_aborted_before_its_first_token_still_has_the_role(
    http: aiohttp.ClientSession,
) -> None:
    """A chat stream whose request ends before any token (the engine shut down during the
    prefill) still opens with the role delta, then usage and [DONE]."""
    msgs = [{"role": "user", "content": "tell me more " * 1500}]
    body = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        serving(server_config(time_scale=1.0)) as sim,
        http.post(f"{sim.url}/v1/chat/completions", json=body) as resp,
    ):
        await asyncio.sleep(0.01)
        sim.engine.shutdown()
        events = [data async for _, data in sse_events(resp)]
    assert orjson.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert orjson.loads(events[1])["usage"]["completion_tokens"] == 0
    assert events[-1] == "[DONE]"
