"""What the h2 ext_proc server checks of its clients beyond HTTP/2's own rules, as grpc's core
does: a call's request headers (``:method``, ``content-type``, ``grpc-timeout``), client PINGs
(grpc's ping strikes) and streams reset before their answer (rapid reset, CVE-2023-44487).

Pure state and parsing, no I/O: ``h2grpc`` feeds them what it reads and acts on the verdicts.
"""

from __future__ import annotations

import math
import re
from enum import Enum

# grpc core's max_ping_strikes (GRPC_ARG_HTTP2_MAX_PING_STRIKES): the third PING too soon ends
# the connection.
MAX_PING_STRIKES = 2
# Envoy's premature_reset_min_stream_lifetime_seconds: a stream reset sooner than this after it
# was opened, unanswered, is premature.
PREMATURE_RESET_SECONDS = 1.0

# gRPC over HTTP/2 (doc/PROTOCOL-HTTP2.md): "grpc-timeout" TimeoutValue TimeoutUnit, at most 8
# ASCII digits (``re.ASCII``: Unicode digits are no digits here).
_TIMEOUT = re.compile(rb"([0-9]{1,8})([HMSmun])", re.ASCII)
_TIMEOUT_UNIT_SECONDS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


class ContentType(Enum):
    """What a request's ``content-type`` makes of it."""

    GRPC = "grpc"  # application/grpc or application/grpc+proto, parameters allowed
    OTHER_CODEC = "other codec"  # gRPC with a message codec this server does not speak
    NOT_GRPC = "not gRPC"


def content_type_kind(value: bytes) -> ContentType:
    """The gRPC spec's ``application/grpc [("+proto" / "+json" / {custom})]``, with the
    parameters MIME allows after ``;``. ``application/grpcXYZ`` is not gRPC."""
    base = value.partition(b";")[0].strip().lower()
    if base in (b"application/grpc", b"application/grpc+proto"):
        return ContentType.GRPC
    if base.startswith(b"application/grpc+"):
        return ContentType.OTHER_CODEC
    return ContentType.NOT_GRPC


def parse_grpc_timeout(value: bytes) -> float:
    """A ``grpc-timeout`` header in seconds; ``ValueError`` when it is malformed."""
    match = _TIMEOUT.fullmatch(value)
    if match is None:
        raise ValueError("a grpc-timeout is 1 to 8 ASCII digits and a unit (H M S m u n)")
    return int(match.group(1)) * _TIMEOUT_UNIT_SECONDS[match.group(2)]


class PingPolicy:
    """grpc core's ping abuse policy: a client PING sooner than ``min_interval`` seconds after
    the previous one is a strike, unless headers or data went by between them (``reset``);
    more than ``MAX_PING_STRIKES`` strikes and the client is told to calm down. Pings are
    permitted without calls (as the grpcio stack's options say)."""

    __slots__ = ("_last", "_strikes", "min_interval")

    def __init__(self, min_interval: float) -> None:
        self.min_interval = min_interval
        self._last = -math.inf
        self._strikes = 0

    def reset(self) -> None:
        self._last = -math.inf
        self._strikes = 0

    def received(self, now: float) -> bool:
        """Count a PING received at ``now``; True when it is one too many."""
        too_soon = now < self._last + self.min_interval
        self._last = now
        if not too_soon:
            return False
        self._strikes += 1
        return self._strikes > MAX_PING_STRIKES


class ResetPolicy:
    """Envoy's premature-reset rule, per connection: a stream the client resets unanswered
    within ``PREMATURE_RESET_SECONDS`` of opening it is premature; the connection is too much
    once premature resets are half of ``limit`` (or half of every stream it opened, past
    ``limit``). A ratio, not a rate: a busy, honest client cancelling requests stays far below
    it, while an open-and-reset flood reaches it in ``limit / 2`` streams. ``limit`` 0: none."""

    __slots__ = ("limit", "opened", "premature")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.opened = 0
        self.premature = 0

    def reset(self, age: float) -> bool:
        """Count a client reset of an unanswered stream opened ``age`` seconds ago; True when
        the connection has now reset too many."""
        if not self.limit or age >= PREMATURE_RESET_SECONDS:
            return False
        self.premature += 1
        return self.premature * 2 >= max(self.opened, self.limit)
