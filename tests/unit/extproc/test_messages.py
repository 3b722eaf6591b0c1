"""Response builders: chunking and the error body."""

from __future__ import annotations

import orjson
import pytest

from endpoint_picker.errors import ErrorCode
from endpoint_picker.extproc import messages, wire


@pytest.mark.parametrize(
    "size", [0, 1, wire.MAX_STREAMED_CHUNK, wire.MAX_STREAMED_CHUNK + 1, 200_000]
)
@pytest.mark.parametrize("end", [True, False])
def test_chunks_rejoin_and_only_the_last_ends(size: int, end: bool) -> None:
    """Chunks are at most 62,000 bytes, rejoin byte-exact, and only the last ends the stream."""
    body = bytes(i % 251 for i in range(size))
    chunks = list(messages.streamed_chunks(body, end))
    assert b"".join(c for c, _ in chunks) == body
    assert all(len(c) <= wire.MAX_STREAMED_CHUNK for c, _ in chunks)
    assert [eos for _, eos in chunks] == [False] * (len(chunks) - 1) + [end]


def test_immediate_error_is_openai_shaped_json() -> None:
    """An error is an immediate response with the status and OpenAI-style JSON body."""
    msg = messages.immediate_error(ErrorCode.NOT_FOUND, "no such model").immediate_response
    assert msg.status.code == 404
    assert orjson.loads(msg.body) == {
        "error": {"message": "no such model", "type": "NotFound", "code": 404}
    }
    header = msg.headers.set_headers[0].header
    assert (header.key, header.raw_value) == ("content-type", b"application/json")
