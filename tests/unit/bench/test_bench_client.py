"""The open-loop SSE client against a tiny aiohttp server on 127.0.0.1: timing, usage, errors."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from endpoint_picker.bench.client import PREVIOUS_TURN_FAILED, _with_replies, run_requests
from endpoint_picker.bench.model import ASSISTANT_PLACEHOLDER as PH
from endpoint_picker.bench.model import RequestSpec

FIRST_TOKEN_DELAY = 0.05


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


class SseServer:
    """Streams OpenAI-style SSE; the prompt (or last user message) picks the behaviour."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.replies = 0
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        self.url = ""

    async def start(self) -> SseServer:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _stream(
        self, request: web.Request, texts: list[dict[str, Any]], delay: float
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_sse(texts[0]))  # empty text: not the first token
        await asyncio.sleep(delay)
        for event in texts[1:]:
            raw = _sse(event)
            await response.write(raw[:9])  # an event split across writes
            await response.write(raw[9:])
        usage = {"prompt_tokens": 7, "completion_tokens": len(texts) - 1}
        await response.write(_sse({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        prompt = body["prompt"]
        if prompt == "fail":
            return web.json_response({"error": {"message": "x" * 5000}}, status=503)
        if prompt == "broken":
            broken: list[dict[str, Any]] = [
                {"choices": [{"text": ""}]},
                {"error": {"message": "engine died"}},
            ]
            return await self._stream(request, broken, 0)
        delay = 0.3 if prompt == "slow" else FIRST_TOKEN_DELAY
        texts = [{"choices": [{"text": t}]} for t in ("", "ab", "cd", "ef")]
        return await self._stream(request, texts, delay)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["messages"][-1]["content"] == "fail":
            return web.json_response({"error": {"message": "no"}}, status=429)
        self.replies += 1
        texts = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]}] + [
            {"choices": [{"delta": {"content": t}}]} for t in ("re", "ply", str(self.replies))
        ]
        return await self._stream(request, texts, 0)


@pytest.fixture
async def server() -> AsyncIterator[SseServer]:
    sse = await SseServer().start()
    yield sse
    await sse.stop()


def completion(index: int, at: float = 0.0, prompt: str = "hello") -> RequestSpec:
    body = {
        "model": "m",
        "prompt": prompt,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return RequestSpec(index, at, "/v1/completions", body)


def chat(index: int, *messages: str, at: float = 0.0, follows: int | None = None) -> RequestSpec:
    """A chat turn; messages alternate user, assistant, user, ..."""
    roles = ("user", "assistant")
    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": roles[i % 2], "content": m} for i, m in enumerate(messages)],
    }
    return RequestSpec(index, at, "/v1/chat/completions", body, follows=follows)


async def test_stream_gives_ttft_e2e_and_usage(server: SseServer) -> None:
    """TTFT is at the first non-empty token; usage comes from the final chunk."""
    [rec] = await run_requests(server.url, [completion(0)], label="t", progress=False)
    assert rec.ok
    assert rec.error == ""
    assert rec.ttft is not None
    assert rec.e2e is not None
    assert FIRST_TOKEN_DELAY <= rec.ttft <= rec.e2e < 1.0
    assert (rec.prompt_tokens, rec.output_tokens) == (7, 3)
    assert rec.reply_text == ""  # nobody follows it: not kept


async def test_requests_are_sent_on_schedule_not_after_earlier_ones(server: SseServer) -> None:
    """Open loop: a request goes out when due even while an earlier one is still streaming."""
    specs = [completion(0, 0.0, "slow"), completion(1, 0.05)]
    slow, fast = await run_requests(server.url, specs, label="t", progress=False)
    assert fast.sent_at < 0.2
    assert fast.due_at == 0.05
    assert slow.e2e is not None
    assert fast.e2e is not None
    assert fast.sent_at + fast.e2e < slow.sent_at + slow.e2e


async def test_error_status_keeps_a_clipped_body(server: SseServer) -> None:
    """A non-200 answer records its status and the start of its body."""
    [rec] = await run_requests(
        server.url, [completion(0, prompt="fail")], label="t", progress=False
    )
    assert (rec.status, rec.ok, rec.ttft, rec.e2e) == (503, False, None, None)
    assert rec.error.startswith('{"error"')
    assert len(rec.error) <= 300


async def test_error_event_in_a_200_stream_is_a_failure(server: SseServer) -> None:
    """vLLM's mid-stream error event makes the request fail although the status was 200."""
    [rec] = await run_requests(
        server.url, [completion(0, prompt="broken")], label="t", progress=False
    )
    assert rec.status == 200
    assert not rec.ok
    assert "engine died" in rec.error


async def test_timeout_is_a_failed_request(server: SseServer) -> None:
    """A stream that outlasts request_timeout fails with the status it had."""
    [rec] = await run_requests(
        server.url, [completion(0, prompt="slow")], label="t", request_timeout=0.1, progress=False
    )
    assert (rec.status, rec.e2e) == (200, None)
    assert "Timeout" in rec.error


async def test_connection_refused_is_status_zero() -> None:
    """No HTTP answer at all (nothing listening) is recorded as status 0."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the request
    [rec] = await run_requests(
        f"http://127.0.0.1:{port}", [completion(0)], label="t", progress=False
    )
    assert (rec.status, rec.ok) == (0, False)
    assert rec.error


async def test_chat_turn_quotes_the_previous_reply(server: SseServer) -> None:
    """A following turn waits for its predecessor and carries its reply in place of the
    placeholder; its due time is when the predecessor finished."""
    specs = [
        chat(0, "hi"),
        chat(1, "hi", PH, "more", follows=0),
        chat(2, "hi", PH, "more", PH, "again", follows=1),
    ]
    first, second, third = await run_requests(server.url, specs, label="t", progress=False)
    assert first.ok
    assert second.ok
    assert third.ok
    assert first.reply_text == "reply1"
    assert second.reply_text == "reply2"
    assert [m["content"] for m in server.bodies[1]["messages"]] == ["hi", "reply1", "more"]
    assert [m["content"] for m in server.bodies[2]["messages"]][1:4:2] == ["reply1", "reply2"]
    assert first.e2e is not None
    assert second.due_at == pytest.approx(first.sent_at + first.e2e)
    assert second.sent_at >= second.due_at


async def test_turn_after_a_failed_turn_is_skipped(server: SseServer) -> None:
    """If the followed turn failed, the next turn is not sent and says why."""
    specs = [chat(0, "fail"), chat(1, "fail", PH, "more", follows=0)]
    first, second = await run_requests(server.url, specs, label="t", progress=False)
    assert first.status == 429
    assert (second.status, second.error) == (0, PREVIOUS_TURN_FAILED)
    assert len(server.bodies) == 1


async def test_progress_bar_counts_completions(
    server: SseServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The progress bar is labelled with the target and reaches completed/total."""
    await run_requests(server.url, [completion(0), completion(1)], label="rr @ 5/s")
    err = capsys.readouterr().err
    assert "rr @ 5/s" in err
    assert "2/2" in err


def test_placeholders_are_filled_newest_reply_last() -> None:
    """The k-th placeholder from the end gets the reply k turns back; others in the body stay."""
    body: dict[str, Any] = {
        "x": 1,
        "messages": [
            {"role": "assistant", "content": PH},
            {"role": "assistant", "content": f"said: {PH}"},
        ],
    }
    filled = _with_replies(body, ["new", "old"])
    assert [m["content"] for m in filled["messages"]] == ["old", "said: new"]
    assert filled["x"] == 1
    assert body["messages"][0]["content"] == PH
