"""The open-loop streaming client: sends every request of a workload when it is due, times it.

Open loop: a request goes out at its ``spec.at`` whatever happened to earlier ones, so a slow
router sees its queue grow as it would in production instead of the client politely backing off.
The one exception is a chat turn that ``follows`` an earlier one: it waits for that turn's reply
(a user cannot answer before reading), so it is due at ``max(spec.at, previous finished)`` and its
``due_at`` says so; the lag measured against it is then the client's alone.

CPU is scarce (two cores shared with the fleet, Envoy and the router), so SSE is parsed from raw
chunks: lines are split in bytes and only ``data:`` lines are decoded, with orjson.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import aiohttp
import orjson

from endpoint_picker.bench.model import (
    ASSISTANT_PLACEHOLDER,
    FAIRNESS_HEADER,
    INDEX_HEADER,
    BenchError,
    RequestRecord,
    RequestSpec,
)
from endpoint_picker.bench.progress import Progress, report_progress

PREVIOUS_TURN_FAILED = "previous turn failed"
_ERROR_CLIP = 300  # characters of an error body kept in a record
_DONE = b"[DONE]"


async def run_requests(
    base_url: str,
    specs: Sequence[RequestSpec],
    *,
    label: str,
    request_timeout: float = 300.0,
    progress: bool = True,
) -> list[RequestRecord]:
    """Send ``specs`` to ``base_url`` on their schedule; one record per spec, in spec order.

    ``label`` names the progress bar (the target). ``request_timeout`` bounds one request from
    send to last byte. Raises ``BenchError`` if a spec follows an index that is not in ``specs``.
    """
    by_index = {spec.index: spec for spec in specs}
    followed = {spec.follows for spec in specs if spec.follows is not None}
    if missing := followed - by_index.keys():
        raise BenchError(f"chat turns follow unknown request indexes: {sorted(missing)[:5]}")
    run = _Run(base_url.rstrip("/"), by_index, followed, request_timeout)
    with report_progress(label, len(specs), enabled=progress) as bar:
        run.bar = bar
        # limit=0: an open-loop client must never queue requests behind a pool limit.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            run.session = session
            await run.dispatch(sorted(specs, key=lambda s: s.at))
    return [run.records[spec.index] for spec in specs]


class _Run:
    """State of one ``run_requests`` call: the clock, finished turns, the records."""

    def __init__(
        self,
        base_url: str,
        specs: dict[int, RequestSpec],
        followed: set[int],
        request_timeout: float,
    ) -> None:
        self.base_url = base_url
        self.specs = specs
        self.followed = followed
        self.timeout = aiohttp.ClientTimeout(total=request_timeout)
        self.records: dict[int, RequestRecord] = {}
        self.finished: dict[int, asyncio.Future[RequestRecord]] = {}
        self.session: aiohttp.ClientSession
        self.bar: Progress
        self.loop = asyncio.get_running_loop()
        self.start = 0.0

    def now(self) -> float:
        return self.loop.time() - self.start

    async def dispatch(self, specs: Sequence[RequestSpec]) -> None:
        """Start each request at its time; a TaskGroup so a bug in one cancels the run."""
        self.finished = {i: self.loop.create_future() for i in self.followed}
        self.start = self.loop.time()
        async with asyncio.TaskGroup() as group:
            for spec in specs:
                delay = spec.at - self.now()
                if delay > 0:
                    await asyncio.sleep(delay)
                group.create_task(self.one(spec))

    async def one(self, spec: RequestSpec) -> None:
        due = spec.at
        body = spec.body
        if spec.follows is not None:
            previous = await self.finished[spec.follows]
            if not previous.ok or previous.e2e is None:
                now = self.now()
                self.finish(
                    spec,
                    RequestRecord(
                        spec.index, now, now, 0, None, None, 0, 0, error=PREVIOUS_TURN_FAILED
                    ),
                )
                return
            due = max(spec.at, previous.sent_at + previous.e2e)
            body = _with_replies(body, self.replies(spec.follows))
        self.finish(spec, await self.send(spec, body, due))

    def replies(self, index: int | None) -> list[str]:
        """Replies along the ``follows`` chain, newest first (all of them have finished)."""
        out: list[str] = []
        while index is not None:
            out.append(self.records[index].reply_text)
            index = self.specs[index].follows
        return out

    def finish(self, spec: RequestSpec, record: RequestRecord) -> None:
        model = spec.body.get("model")
        tenant = spec.headers.get(FAIRNESS_HEADER, "")
        record = replace(record, model=model if isinstance(model, str) else "", tenant=tenant)
        self.records[spec.index] = record
        if (future := self.finished.get(spec.index)) is not None:
            future.set_result(record)
        self.bar.update(1)

    async def send(self, spec: RequestSpec, body: dict[str, Any], due: float) -> RequestRecord:
        keep_text = spec.index in self.followed
        headers = {
            "Content-Type": "application/json",
            INDEX_HEADER: str(spec.index),
            **spec.headers,
        }
        data = orjson.dumps(body)
        sent = self.now()
        status = 0
        stream = _Stream(keep_text)
        try:
            async with self.session.post(
                self.base_url + spec.path, data=data, headers=headers, timeout=self.timeout
            ) as response:
                status = response.status
                if status != 200:
                    raw = await response.content.read(_ERROR_CLIP * 4)
                    error = raw.decode(errors="replace")[:_ERROR_CLIP]
                    return RequestRecord(spec.index, due, sent, status, None, None, 0, 0, error)
                async for chunk in response.content.iter_any():
                    stream.feed(chunk, self.now() - sent)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:_ERROR_CLIP]
            return stream.record(spec.index, due, sent, status, e2e=None, error=error)
        # An error event inside a 200 stream (vLLM's way to fail mid-way) is a failed request.
        e2e = None if stream.error else self.now() - sent
        return stream.record(spec.index, due, sent, status, e2e=e2e, error=stream.error)


class _Stream:
    """Incremental SSE parser for OpenAI streaming responses (completions and chat)."""

    __slots__ = ("buffer", "chunks", "error", "keep_text", "prompt_tokens", "text", "ttft", "usage")

    def __init__(self, keep_text: bool) -> None:
        self.buffer = b""
        self.keep_text = keep_text
        self.text: list[str] = []
        self.ttft: float | None = None
        self.chunks = 0  # chunks with token text: the output length if no usage arrives
        self.usage: int | None = None
        self.prompt_tokens = 0
        self.error = ""

    @property
    def output_tokens(self) -> int:
        return self.usage if self.usage is not None else self.chunks

    def record(
        self, index: int, due: float, sent: float, status: int, *, e2e: float | None, error: str
    ) -> RequestRecord:
        return RequestRecord(
            index=index,
            due_at=due,
            sent_at=sent,
            status=status,
            ttft=self.ttft,
            e2e=e2e,
            output_tokens=self.output_tokens,
            prompt_tokens=self.prompt_tokens,
            error=error,
            reply_text="".join(self.text),
        )

    def feed(self, chunk: bytes, elapsed: float) -> None:
        lines = (self.buffer + chunk).split(b"\n")
        self.buffer = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                self._event(line[5:].strip(), elapsed)

    def _event(self, payload: bytes, elapsed: float) -> None:
        if payload == _DONE:
            return
        try:
            event = orjson.loads(payload)
            if "error" in event:  # vLLM reports mid-stream failures as an event
                self.error = str(event["error"])[:_ERROR_CLIP]
            if usage := event.get("usage"):
                self.usage = int(usage.get("completion_tokens") or 0)
                self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            choices = event.get("choices")
            if not choices:
                return
            choice = choices[0]
            text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
            self.error = f"bad SSE event: {exc}"[:_ERROR_CLIP]
            return
        if text:
            self.chunks += 1
            if self.ttft is None:
                self.ttft = elapsed
            if self.keep_text:
                self.text.append(text)


def _with_replies(body: dict[str, Any], replies: list[str]) -> dict[str, Any]:
    """``body`` with its assistant placeholders filled: the last gets ``replies[0]`` and so on.

    A workload may quote only the previous reply or the whole history; either way the k-th
    placeholder from the end is the reply k turns back. Placeholders beyond the chain become "".
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    out: list[Any] = []
    k = sum(_has_placeholder(m) for m in messages)
    for message in messages:
        if _has_placeholder(message):
            k -= 1
            reply = replies[k] if k < len(replies) else ""
            content = message["content"].replace(ASSISTANT_PLACEHOLDER, reply)
            message = {**message, "content": content}
        out.append(message)
    return {**body, "messages": out}


def _has_placeholder(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("content"), str)
        and ASSISTANT_PLACEHOLDER in message["content"]
    )
