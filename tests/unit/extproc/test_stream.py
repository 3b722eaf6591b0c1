"""Small rules of the stream state machine."""

from __future__ import annotations

import pytest

from endpoint_picker.extproc.stream import _safe_request_id


@pytest.mark.parametrize(
    ("raw", "kept"),
    [
        ("abc-123", "abc-123"),
        ("x" * 500, "x" * 128),
        ("bad\nline", ""),
        ("caf\u00e9", ""),
    ],
)
def test_request_ids_are_bounded_and_printable(raw: str, kept: str) -> None:
    """Client request ids are logged only when printable ASCII, and at most 128 characters."""
    assert _safe_request_id(raw) == kept
