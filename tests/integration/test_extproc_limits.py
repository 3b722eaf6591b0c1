"""Process-wide limits through the real gRPC server: the buffered-body budget, the stream cap."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from tests.support.extproc import (
    Client,
    body,
    error_of,
    header_map,
    headers,
    json_body,
    lb_metadata,
    make_settings,
    running_app,
)
from tests.support.polling import until
from tests.support.pool import ONE_POD

from endpoint_picker.app import App
from endpoint_picker.settings import Settings

# each test runs on both gRPC stacks of the ext_proc port (tests/integration/conftest.py)
pytestmark = pytest.mark.usefixtures("ext_proc_server")

RAW = json_body({"model": "m", "prompt": "x" * 450_000})  # one request body, ~450 kB
PART = 400_000  # what each open stream holds before it finishes its body


def limited(tmp_path: Path, **server: Any) -> Settings:
    settings = make_settings(tmp_path, ONE_POD)
    return replace(settings, server=replace(settings.server, **server))


def sample(app: App, name: str, **labels: str) -> float:
    return app.metrics.registry.get_sample_value(name, labels) or 0.0


def buffered(app: App) -> float:
    return sample(app, "inference_extension_buffered_request_bytes")


async def open_with_partial_body(client: Client) -> grpc.aio.StreamStreamCall:
    call = client.stub.Process()
    await call.write(headers())
    await call.write(body(RAW[:PART], end_of_stream=False))
    return call


async def rest(call: grpc.aio.StreamStreamCall) -> list[Any]:
    """Half-close and read what is left (read(), not iteration: a call takes one style)."""
    await call.done_writing()
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message)
    return out


async def finish(call: grpc.aio.StreamStreamCall) -> str:
    """Send the rest of the body; the destination the EPP routed it to."""
    await call.write(body(RAW[PART:]))
    first = await call.read()
    await rest(call)
    return lb_metadata(first)


def assert_json_429(response: Any) -> None:
    status, error = error_of(response)
    assert (status, error["error"]["type"], error["error"]["code"]) == (
        429,
        "ResourceExhausted",
        429,
    )
    assert header_map(response.immediate_response.headers)["content-type"] == "application/json"


async def test_body_budget_is_shared_across_streams_429_past_it_and_freed_on_end_or_cancel(
    tmp_path: Path,
) -> None:
    """Past the process-wide budget a body gets a JSON 429; routing and cancelling give it back."""
    settings = limited(tmp_path, max_request_body_bytes=600_000, max_buffered_bytes=1_000_000)
    async with running_app(settings) as (app, client):
        a = await open_with_partial_body(client)
        b = await open_with_partial_body(client)
        await until(lambda: buffered(app) == 2 * PART)
        # a third stream's 400 kB would take the process past 1 MB
        c = await open_with_partial_body(client)
        assert_json_429(await c.read())
        assert buffered(app) == 2 * PART  # the refused chunk was never kept
        a.cancel()
        await until(lambda: buffered(app) == PART)
        d = await open_with_partial_body(client)  # fits now that a's bytes came back
        await until(lambda: buffered(app) == 2 * PART)
        assert await finish(b) == await finish(d) == "127.0.0.2:8000"
        await until(lambda: buffered(app) == 0)
        assert sample(app, "inference_extension_buffer_budget_rejections_total") == 1
        errors = sample(
            app,
            "inference_model_request_error_total",
            model_name="",
            target_model_name="",
            error_code="InferencePoolResourceExhausted",
        )
        assert errors == 1


async def test_stream_ended_without_its_body_gives_the_budget_back(tmp_path: Path) -> None:
    """A client that stops writing mid-body (half-close) leaves no reservation behind."""
    settings = limited(tmp_path, max_request_body_bytes=600_000, max_buffered_bytes=1_000_000)
    async with running_app(settings) as (app, client):
        call = await open_with_partial_body(client)
        await until(lambda: buffered(app) == PART)
        assert await rest(call) == []
        await until(lambda: buffered(app) == 0)


async def test_concurrent_stream_cap_answers_json_429_and_frees_slots(tmp_path: Path) -> None:
    """Past --max-concurrent-streams a new stream gets a JSON 429; a closed stream frees a slot."""
    settings = limited(tmp_path, max_concurrent_streams=2)
    streams = "inference_extension_ext_proc_streams"
    async with running_app(settings) as (app, client):
        a = await open_with_partial_body(client)
        b = await open_with_partial_body(client)
        await until(lambda: sample(app, streams) == 2)
        refused = await client.exchange([headers(), body(RAW)])
        assert len(refused) == 1
        assert_json_429(refused[0])
        assert sample(app, "inference_extension_stream_limit_rejections_total") == 1
        assert (
            sample(
                app,
                "inference_model_request_error_total",
                model_name="",
                target_model_name="",
                error_code="InferencePoolResourceExhausted",
            )
            == 1
        )
        a.cancel()
        await until(lambda: sample(app, streams) == 1)
        routed = await client.exchange([headers(), body(RAW)])
        assert lb_metadata(routed[0]) == "127.0.0.2:8000"
        assert await finish(b) == "127.0.0.2:8000"
        await until(lambda: sample(app, streams) == 0)


async def test_more_than_a_hundred_open_streams_on_one_connection(tmp_path: Path) -> None:
    """An ext_proc stream lives as long as its request: one connection (as Envoy keeps) holds
    150 of them at once, none refused by HTTP/2's stream limit (h2 announces 100 unless told)."""
    settings = limited(tmp_path)
    async with running_app(settings) as (app, client):
        calls = [await open_with_partial_body(client) for _ in range(150)]
        await until(lambda: sample(app, "inference_extension_ext_proc_streams") == 150)
        routed = await asyncio.gather(*(finish(call) for call in calls))
        assert routed == ["127.0.0.2:8000"] * 150
