"""Usage extraction from JSON bodies and SSE streams."""

from __future__ import annotations

from endpoint_picker.telemetry.usage import Usage, UsageReader


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
