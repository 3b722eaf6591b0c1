"""Log lines as rendered: a client's strings reach them cut and escaped, tracebacks whole."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import structlog

from endpoint_picker.telemetry import logs


@pytest.fixture
def restored() -> Iterator[None]:
    """structlog's configuration and context put back after the test."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
    structlog.contextvars.clear_contextvars()


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_long_and_control_laden_client_strings_are_cut_and_escaped(
    fmt: str, restored: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 2 MB model name and a request id with a newline and a right-to-left override (bound
    in the context, as the stream binds it) give one line of a few KB, escapes visible."""
    logs.configure_logging(fmt, "info")
    structlog.contextvars.bind_contextvars(request_id="id\nforged line \u202eevil")
    structlog.get_logger("t").info("request rejected", model="m" * (2 * 1024 * 1024))
    text = capsys.readouterr().err
    assert text.count("\n") == 1
    assert len(text) < 3000
    assert "\u202e" not in text
    if fmt == "json":
        line = json.loads(text)
        assert line["request_id"] == "id\\u000aforged line \\u202eevil"
        assert line["model"].startswith("mmm")
        assert "characters in all" in line["model"]
    else:
        assert "id\\\\u000aforged line \\\\u202eevil" in text  # repr doubles the escape
