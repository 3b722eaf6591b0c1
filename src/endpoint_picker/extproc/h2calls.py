"""One gRPC call of the h2 ext_proc server: its state, gRPC's framing and status codes, and the
narrow view of the server its connection needs (``Host``). No I/O here."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from typing import Protocol

from h2.config import H2Configuration

from endpoint_picker.errors import clip
from endpoint_picker.extproc import wire
from endpoint_picker.extproc.limits import BodyBudget
from endpoint_picker.extproc.session import ExternalProcessor, Session
from endpoint_picker.settings import GrpcConnectionSettings

PROCESS_PATH = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH_CHECK_PATH = b"/grpc.health.v1.Health/Check"
# How long a call whose answer is complete holds its status for the client to end its side;
# then the status goes and the stream is reset (RFC 9113, 8.1: NO_ERROR, "stop sending").
# Envoy ends its side at once.
CLIENT_REST_SECONDS = 1.0
# What a call may hold unread: one message of the largest size and its prefix. Past it (a
# client sending on while its request waits in flow control) the call is refused.
MAX_UNREAD_BYTES = wire.MAX_MESSAGE_BYTES + 5
MAX_STREAM_ID = 2**31 - 1
# A method or content-type echoed in an error: no more than this (HPACK encodes it per call).
_MAX_ECHOED = 128

# gRPC status codes (grpc/doc/statuscodes.md)
OK, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND = 0, 2, 3, 4, 5
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 8, 12, 13

H2_CONFIG = H2Configuration(
    client_side=False,
    header_encoding=None,
    # Our own headers are fixed and valid: skip h2's per-send checks. Inbound ones stay checked.
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
)
RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))


class Health(Protocol):
    def status(self, service: str) -> int | None: ...


class Host(Protocol):
    """What a connection reads and shares of its server (``h2grpc.H2GrpcServer``)."""

    processor: ExternalProcessor
    health: Health
    budget: BodyBudget
    limits: GrpcConnectionSettings
    max_unread_bytes: int
    stopping: bool
    # the connections open (the drain walks them) and the flow-control waits being cancelled
    connections: weakref.WeakSet[ConnectionLike]
    cancelled: set[asyncio.Task[None]]


class ConnectionLike(Protocol):
    """What the server does with a connection: drain it."""

    @property
    def busy(self) -> bool: ...

    lost: asyncio.Future[None]

    def goaway(self, last_stream_id: int = MAX_STREAM_ID) -> None: ...

    def last_goaway(self) -> None: ...

    def cancel(self) -> None: ...


def frame(message: bytes) -> bytes:
    """gRPC's length-prefixed message: not compressed, then the length (big-endian)."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def status_headers(code: int, message: str) -> list[tuple[bytes, bytes]]:
    headers = [(b"grpc-status", str(code).encode())]
    if message:
        headers.append((b"grpc-message", percent_encode(message)))
    return headers


def percent_encode(text: str) -> bytes:
    """grpc-message's encoding: printable ASCII but ``%`` as is, every other byte as %XX."""
    return b"".join(
        bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
        for b in text.encode("utf-8")
    )


class CallError(Exception):
    """Ends a call with a gRPC status (the message's own fault, not the server's)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Call:
    """One gRPC call: an HTTP/2 stream of ``Process`` or ``Check``."""

    __slots__ = (
        "answered",
        "buffer",
        "deadline",
        "ended",
        "headers_sent",
        "held",
        "is_health",
        "opened_at",
        "outbox",
        "rest_timer",
        "session",
        "stream_id",
        "trailers",
        "unacked",
        "waiting",
    )

    def __init__(
        self, stream_id: int, is_health: bool, session: Session | None, opened_at: float
    ) -> None:
        self.stream_id = stream_id
        self.is_health = is_health
        self.session = session  # Process only; None for health, or a stream refused at the limit
        self.opened_at = opened_at
        self.buffer = bytearray()  # received bytes not yet decoded into messages
        self.held = 0  # bytes of the shared body budget the buffer holds
        self.unacked = 0  # flow-controlled bytes received and not yet acknowledged
        self.deadline: asyncio.TimerHandle | None = None  # the client's grpc-timeout
        self.ended = False  # the client has ended its side
        self.answered = False  # our trailers are sent or queued: nothing more to answer
        self.headers_sent = False
        self.outbox: list[memoryview] = []  # framed data waiting for the client's window
        self.trailers: Sequence[tuple[bytes, bytes]] | None = None  # sent once the outbox is empty
        self.waiting: asyncio.Task[None] | None = None  # while the request waits in flow control
        self.rest_timer: asyncio.TimerHandle | None = None


def echo(value: bytes) -> str:
    """A client's value as an error message quotes it: decoded, and cut."""
    return clip(value.decode("utf-8", "replace"), _MAX_ECHOED)


def next_message(call: Call, budget: BodyBudget) -> bytes | None:
    """The call's next complete message, taken out of its buffer (its bytes given back to the
    budget); None until one is complete. ``CallError`` for one this server does not take."""
    buffer = call.buffer
    if len(buffer) < 5:
        return None
    if buffer[0]:
        raise CallError(UNIMPLEMENTED, "compressed messages are not supported")
    size = int.from_bytes(buffer[1:5], "big")
    if size > wire.MAX_MESSAGE_BYTES:
        raise CallError(
            RESOURCE_EXHAUSTED,
            f"a message of {size} bytes exceeds the limit of {wire.MAX_MESSAGE_BYTES}",
        )
    if len(buffer) < 5 + size:
        return None
    message = bytes(buffer[5 : 5 + size])
    del buffer[: 5 + size]
    call.held -= 5 + size
    budget.release(5 + size)
    return message
