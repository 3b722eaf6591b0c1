"""Read token ``usage`` from model-server responses: whole JSON bodies and SSE streams.

Fed chunk by chunk as they pass; never delays a chunk, never holds more than it must.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import orjson

_MAX_JSON_BODY = 8 * 1024 * 1024  # past this a JSON body is not kept for usage
_MAX_SSE_LINE = 1024 * 1024  # an event line longer than this is dropped unread
# No request uses more tokens than its model's context window; the longest offered today is
# 10M tokens (Llama 4 Scout). 2**26 (67M) leaves room for growth, while a larger count is a
# model-server bug that would swamp the token histograms' sums.
MAX_TOKENS = 2**26


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


class _Invalid(Enum):
    """A usage report that is there but not a plausible count."""

    USAGE = "invalid"


_INVALID = _Invalid.USAGE


def _count(value: object) -> int | None:
    # ``type(...) is int``: JSON ``true`` decodes to a bool, which isinstance calls an int.
    return value if type(value) is int and 0 <= value <= MAX_TOKENS else None


def _usage_of(obj: object) -> Usage | _Invalid | None:
    """The object's usage; ``None`` when it reports none, ``_INVALID`` when it reports junk."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if usage is None:
        return None
    if not isinstance(usage, dict):
        return _INVALID
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if prompt is None or completion is None:  # e.g. embeddings report no completion tokens
        return None
    prompt_count, completion_count = _count(prompt), _count(completion)
    if prompt_count is None or completion_count is None:
        return _INVALID
    return Usage(prompt_count, completion_count)


class UsageReader:
    """Accumulates what it needs of one response body to find its usage.

    The last usage report wins (streams with continuous usage repeat a growing one); when it
    is not a plausible count, ``usage`` is ``None`` and ``invalid`` is set.
    """

    def __init__(self, content_type: str = "") -> None:
        self.sse = "text/event-stream" in content_type.lower()
        self.usage: Usage | None = None
        self.invalid = False
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
                    self._take(found)

    def _take(self, found: Usage | _Invalid | None) -> None:
        self.invalid = found is _INVALID
        self.usage = found if isinstance(found, Usage) else None

    def finish(self) -> Usage | None:
        """Call at end of stream; returns the usage found, if any."""
        if self.sse:
            if self._pending:
                self._feed_sse(b"\n")
        elif self._pending and not self._overflow:
            try:
                self._take(_usage_of(orjson.loads(self._pending)))
            except orjson.JSONDecodeError:
                self.usage = None
            self._pending.clear()
        return self.usage
