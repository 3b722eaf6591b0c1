"""Structured logging (structlog): text or JSON lines on stderr, request id bound per request.

Logs carry sizes and ids, never prompts.
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


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
