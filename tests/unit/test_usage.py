"""Usage extraction from JSON bodies and SSE streams."""

from __future__ import annotations

import pytest

from endpoint_picker.requests import MAX_TOKENS, Usage, UsageReader


def test_json_body_split_across_chunks() -> None:
    """A JSON body's usage is read once the body is complete."""
    body = b'{"id": "x", "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}'
    reader = UsageReader("application/json")
    for i in range(0, len(body), 9):
        reader.feed(body[i : i + 9])
    assert reader.finish() == Usage(7, 3)
    assert reader.body_bytes == len(body)


def test_sse_usage_chunk_split_mid_line() -> None:
    """The usage chunk of an SSE stream is found even when split mid-line."""
    stream = (
        b'data: {"choices": [{"text": "a"}], "usage": null}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}\n\n'
        b"data: [DONE]\n\n"
    )
    reader = UsageReader("text/event-stream; charset=utf-8")
    for i in range(0, len(stream), 7):
        reader.feed(stream[i : i + 7])
    assert reader.finish() == Usage(5, 2)


def test_no_usage_is_none() -> None:
    """Bodies without usage (or not JSON) give None, never an error."""
    reader = UsageReader("application/json")
    reader.feed(b"<html>oops</html>")
    assert reader.finish() is None


@pytest.mark.parametrize(
    "usage",
    [
        b'{"prompt_tokens": -5, "completion_tokens": 3}',
        b'{"prompt_tokens": 7, "completion_tokens": -1}',
        b'{"prompt_tokens": true, "completion_tokens": 3}',
        b'{"prompt_tokens": 7.5, "completion_tokens": 3}',
        b'{"prompt_tokens": "7", "completion_tokens": 3}',
        b'{"prompt_tokens": 7, "completion_tokens": 100000000000}',
        b'"lots"',  # usage itself is not an object
    ],
    ids=[
        "negative-prompt",
        "negative-completion",
        "bool",
        "fraction",
        "string",
        "huge",
        "not-object",
    ],
)
def test_implausible_usage_is_dropped_and_flagged(usage: bytes) -> None:
    """Usage that is not a count in [0, MAX_TOKENS] is not reported, and the reader says so."""
    reader = UsageReader("application/json")
    reader.feed(b'{"id": "x", "usage": ' + usage + b"}")
    assert reader.finish() is None
    assert reader.invalid


def test_last_sse_usage_report_decides_validity() -> None:
    """A stream's last usage report wins: junk after a valid one drops it; a valid one clears."""
    good = b'data: {"usage": {"prompt_tokens": 5, "completion_tokens": 2}}\n\n'
    junk = b'data: {"usage": {"prompt_tokens": 5, "completion_tokens": -2}}\n\n'
    reader = UsageReader("text/event-stream")
    reader.feed(good + junk)
    assert (reader.finish(), reader.invalid) == (None, True)
    reader = UsageReader("text/event-stream")
    reader.feed(junk + good)
    assert (reader.finish(), reader.invalid) == (Usage(5, 2), False)


def test_usage_at_the_bound_and_absent_usage_are_not_invalid() -> None:
    """MAX_TOKENS itself is a count; a body without usage is not flagged."""
    reader = UsageReader("application/json")
    reader.feed(b'{"usage": {"prompt_tokens": %d, "completion_tokens": 0}}' % MAX_TOKENS)
    assert (reader.finish(), reader.invalid) == (Usage(MAX_TOKENS, 0), False)
    reader = UsageReader("application/json")
    reader.feed(b'{"usage": null}')
    assert (reader.finish(), reader.invalid) == (None, False)
