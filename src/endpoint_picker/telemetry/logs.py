"""Structured logging (structlog): text or JSON lines on stderr, request id bound per request.

Logs carry sizes and ids, never prompts. Every string value is cut to ``LOG_VALUE_CHARS`` and
shown with control and bidi characters escaped (``errors.kept``, ``errors.shown``) as the last
step before rendering: a client's request id, model name or path reaches many lines, and one
with a newline must not forge a line, one of 8 MB must not write 8 MB a line.
"""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.typing import EventDict, WrappedLogger

from endpoint_picker.errors import kept, shown

LOG_VALUE_CHARS = 1000  # a string value in a log line; a traceback is kept whole
_WHOLE = frozenset({"exception", "event"})  # our own text: a traceback, the message

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def bounded_values(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    """A structlog processor: every string value but the traceback and the message, cut and
    escaped (the context's request id included)."""
    for key, value in event.items():
        if type(value) is str and key not in _WHOLE:
            event[key] = shown(kept(value, LOG_VALUE_CHARS))
    return event


def configure_logging(fmt: str = "text", level: str = "info") -> None:
    """Configure structlog once, at start-up, from the CLI."""
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            bounded_values,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries (aiohttp, grpc) log through the standard library: keep them at warning.
    logging.basicConfig(level=max(_LEVELS[level], logging.WARNING), stream=sys.stderr)


def log_levels() -> tuple[str, ...]:
    return tuple(_LEVELS)
