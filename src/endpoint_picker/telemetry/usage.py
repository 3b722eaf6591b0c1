"""Read token ``usage`` from model-server responses: whole JSON bodies and SSE streams.

Fed chunk by chunk as they pass; never delays a chunk, never holds more than it must.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

_MAX_JSON_BODY = 8 * 1024 * 1024  # past this a JSON body is not kept for usage
_MAX_SSE_LINE = 1024 * 1024  # an event line longer than this is dropped unread


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


def _usage_of(obj: object) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Usage(prompt, completion)


class UsageReader:
    """Accumulates what it needs of one response body to find its usage."""

    def __init__(self, content_type: str = "") -> None:
        self.sse = "text/event-stream" in content_type.lower()
        self.usage: Usage | None = None
        self.body_bytes = 0
        self._pending = bytearray()
        self._overflow = False

    def feed(self, chunk: bytes) -> None:
        self.body_bytes += len(chunk)
        if self.sse:
            self._feed_sse(chunk)
        elif not self._overflow:
            if len(self._pending) + len(chunk) > _MAX_JSON_BODY:
                self._overflow = True
                self._pending.clear()
            else:
                self._pending += chunk

    def _feed_sse(self, chunk: bytes) -> None:
        self._pending += chunk
        end = self._pending.rfind(b"\n")
        if end < 0:
            if len(self._pending) > _MAX_SSE_LINE:  # not SSE as we know it: stop holding it
                self._pending.clear()
            return
        complete = bytes(self._pending[: end + 1])
        del self._pending[: end + 1]
        if b'"usage"' not in complete:
            return
        for line in complete.splitlines():
            if line.startswith(b"data:") and b'"usage"' in line:
                try:
                    found = _usage_of(orjson.loads(line[5:]))
                except orjson.JSONDecodeError:
                    continue
                if found is not None:
                    self.usage = found

    def finish(self) -> Usage | None:
        """Call at end of stream; returns the usage found, if any."""
        if self.sse:
            if self._pending:
                self._feed_sse(b"\n")
        elif self._pending and not self._overflow:
            try:
                self.usage = _usage_of(orjson.loads(self._pending))
            except orjson.JSONDecodeError:
                self.usage = None
            self._pending.clear()
        return self.usage
