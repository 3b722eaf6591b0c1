"""Faults through a real Envoy: the EPP restarted behind it, and clients that are slow."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
import pytest_asyncio

from tests.e2e.harness import Backend, backends, e2e_pool, post, running_envoy, running_epp
from tests.support.model_servers import free_port

pytestmark = pytest.mark.e2e

PAYLOAD = {"model": "m", "prompt": "hello"}


@pytest_asyncio.fixture
async def fleet() -> AsyncIterator[list[Backend]]:
    async with backends(("127.0.8.2", "127.0.8.3")) as servers:
        yield servers


async def test_epp_restarted_behind_a_running_envoy(
    tmp_path: Path, fleet: list[Backend], own_session: aiohttp.ClientSession
) -> None:
    """The shipped config fails closed while the EPP is down (a JSON 500 naming the EPP, no
    backend reached) and routes again, without touching Envoy, once an EPP listens again."""
    port = free_port()
    endpoints = [b.hostport for b in fleet]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    async with running_envoy(tmp_path, "reference", epp_port=port, endpoints=endpoints) as envoy:
        async with running_epp(tmp_path / "a", e2e_pool(fleet), port=port) as epp:
            assert epp.ports.ext_proc == port
            deadline = time.monotonic() + 10
            while (await post(own_session, envoy.url, PAYLOAD)).status != 200:
                assert time.monotonic() < deadline, "Envoy never reached the EPP"
                await asyncio.sleep(0.1)
        received = sum(len(b.received) for b in fleet)
        down = await post(own_session, envoy.url, PAYLOAD)
        assert down.status == 500
        assert "endpoint picker" in down.json["error"]["message"]
        assert sum(len(b.received) for b in fleet) == received
        async with running_epp(tmp_path / "b", e2e_pool(fleet), port=port):
            deadline = time.monotonic() + 10
            statuses = []
            while True:
                reply = await post(own_session, envoy.url, PAYLOAD)
                statuses.append(reply.status)
                if reply.status == 200:
                    break
                assert time.monotonic() < deadline, statuses
                await asyncio.sleep(0.1)
            for _ in range(5):  # and it stays up
                assert (await post(own_session, envoy.url, PAYLOAD)).status == 200
        assert set(statuses[:-1]) <= {500}, statuses


async def _trickle(url: str, payload: bytes, gap: float) -> tuple[int, float]:
    """POST ``payload`` one byte every ``gap`` seconds over a raw connection; the status and
    how long the upload took."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(payload)
        )
        started = time.monotonic()
        for byte in payload:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(gap)
        took = time.monotonic() - started
        status_line = await asyncio.wait_for(reader.readline(), 10)
        return int(status_line.split()[1]), took
    finally:
        writer.close()


async def test_a_trickled_body_holds_up_no_other_request(
    tmp_path: Path, fleet: list[Backend], own_session: aiohttp.ClientSession
) -> None:
    """A client sending its body a byte at a time (about 2 s in all) neither blocks the
    requests that arrive meanwhile nor makes the EPP hold more than that one small body."""
    endpoints = [b.hostport for b in fleet]
    payload = orjson.dumps(PAYLOAD)
    async with (
        running_epp(tmp_path, e2e_pool(fleet)) as epp,
        running_envoy(
            tmp_path, "reference", epp_port=epp.ports.ext_proc, endpoints=endpoints
        ) as envoy,
    ):
        slow = asyncio.create_task(_trickle(envoy.url, payload, gap=2.0 / len(payload)))
        await asyncio.sleep(0.2)
        latencies = []
        while not slow.done():
            started = time.monotonic()
            assert (await post(own_session, envoy.url, PAYLOAD)).status == 200
            latencies.append(time.monotonic() - started)
            held = epp.metrics.registry.get_sample_value(
                "inference_extension_buffered_request_bytes"
            )
            assert held is not None
            assert held <= len(payload)
            await asyncio.sleep(0.05)
        status, took = await slow
    assert status == 200
    assert took > 1.5
    assert len(latencies) >= 10
    assert max(latencies) < 0.5, max(latencies)


async def test_a_slow_reader_holds_up_no_other_request(
    tmp_path: Path, fleet: list[Backend], own_session: aiohttp.ClientSession
) -> None:
    """A client that opens a streamed response and does not read it: other requests, and
    other streams, complete as usual; the slow one still gets its whole response later."""
    endpoints = [b.hostport for b in fleet]
    async with (
        running_epp(tmp_path, e2e_pool(fleet)) as epp,
        running_envoy(
            tmp_path, "reference", epp_port=epp.ports.ext_proc, endpoints=endpoints
        ) as envoy,
    ):
        host, port = envoy.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        stream_body = orjson.dumps({**PAYLOAD, "stream": True})
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(stream_body) + stream_body
        )
        await writer.drain()
        try:
            latencies = []
            for _ in range(10):  # while the unread stream runs (about a second)
                started = time.monotonic()
                streamed = await post(own_session, envoy.url, {**PAYLOAD, "stream": True})
                assert streamed.status == 200
                assert streamed.body.endswith(b"data: [DONE]\n\n")
                latencies.append(time.monotonic() - started)
            await asyncio.sleep(0.5)  # the slow reader's response has long finished upstream
            text = b""
            while b"[DONE]" not in text:
                chunk = await asyncio.wait_for(reader.read(65536), 5)
                assert chunk, text
                text += chunk
        finally:
            writer.close()
    assert text.startswith(b"HTTP/1.1 200")
    assert max(latencies) < 2.5, latencies  # each stream lasts about a second by itself
