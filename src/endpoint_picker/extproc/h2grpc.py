"""The ext_proc server on h2 alone: gRPC's two methods served straight from HTTP/2 events.

The EPP serves two gRPC methods on this port, ext_proc's ``Process`` and health's ``Check``,
and answers each ext_proc message synchronously (``RequestStream.handle``) but for a request
that waits in flow control. So this server needs no general gRPC framework: it runs h2's state
machine in the event loop's ``data_received``, decodes each length-prefixed message as its
last byte arrives and answers in the same call, without a task, a queue or a wake-up per
message; a task exists only while a request waits in flow control. Measured through Envoy
(README, "Performance"): the EPP needs 40% less CPU a request than on grpclib, the stack before
this one, and half of what it needs on grpcio.

What it serves, as the grpcio server does: ``Process`` and ``grpc.health.v1.Health/Check`` (from
``HealthState``; any other method is UNIMPLEMENTED, a method but POST is 405, a content-type but
``application/grpc[+proto]`` 415), TLS and mutual TLS through an ``ssl.SSLContext`` with ALPN
``h2``, ``--grpc-max-streams-per-connection`` streams per connection (announced; ``--max-
concurrent-streams`` caps the process with a JSON 429), a message past ``wire.MAX_MESSAGE_BYTES``
refused with RESOURCE_EXHAUSTED before it is buffered, ``grpc-timeout`` (DEADLINE_EXCEEDED),
SO_REUSEPORT for ``--workers``, and the drain of ``stop(grace)``: the listener closes, each
connection gets a GOAWAY naming the largest stream id (RFC 9113, 6.8: the open streams go on,
no new ones; written beside h2, whose state machine refuses every frame after a GOAWAY of its
own), open calls get ``grace``, then a second GOAWAY names the last stream received and the
streams the client opened meanwhile are refused with REFUSED_STREAM for
``_LAST_GOAWAY_SECONDS`` (a gRPC client retries those on another connection; closed at once,
they were lost in a connection reset), then the connections close.

Flow control: a window large enough for a long prompt is announced up front; what arrives is
acknowledged once it is consumed: decoded, or part of the message being assembled (which may
grow to the message limit). Every byte a call holds undecoded counts toward ``--max-buffered-
bytes`` (past it: the JSON 429 of a full buffer); a call waiting in flow control acknowledges
nothing until its wait ends. What is sent waits for the client's window, per stream, in order,
the trailers last, and for the socket: while the transport's buffer is above its high-water
mark nothing more is written and the connection is not read (a client that does not read
cannot make the EPP queue its answers).

Abuse and dead peers, as grpc's core handles them (``h2policy``, flags in
``GrpcConnectionSettings``): too many client PINGs with no data between them, or too many
streams reset right after opening (rapid reset), end the connection with GOAWAY
ENHANCE_YOUR_CALM; a connection that sent nothing for the keepalive time is PINGed and closed
when the PING goes unanswered (its streams end: their in-flight counts and held bytes are
released); one without streams for the idle time gets a GOAWAY, then a final one once the
client has seen it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    PingAckReceived,
    PingReceived,
    RemoteSettingsChanged,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes, Settings
from hyperframe.frame import GoAwayFrame

from endpoint_picker.errors import clip
from endpoint_picker.extproc import wire
from endpoint_picker.extproc.h2policy import (
    ContentType,
    PingPolicy,
    ResetPolicy,
    content_type_kind,
    parse_grpc_timeout,
)
from endpoint_picker.extproc.limits import BodyBudget
from endpoint_picker.extproc.stream import RequestStream
from endpoint_picker.settings import GrpcConnectionSettings

if TYPE_CHECKING:
    from endpoint_picker.extproc.server import ExternalProcessor, HealthState

log = structlog.get_logger(__name__)

PROCESS_PATH = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH_CHECK_PATH = b"/grpc.health.v1.Health/Check"
# How long a call whose answer is complete holds its status for the client to end its side;
# then the status goes and the stream is reset (RFC 9113, 8.1: NO_ERROR, "stop sending").
# Envoy ends its side at once.
CLIENT_REST_SECONDS = 1.0
_CLOSE_SECONDS = 5.0  # how long stop() waits for cancelled flow-control waits to end
# After the drain's final GOAWAY (naming the last stream served), how long the connections stay
# open so that streams the client opened meanwhile are refused with REFUSED_STREAM (which a
# gRPC client retries elsewhere) rather than lost in a connection reset.
_LAST_GOAWAY_SECONDS = 0.1
# How long a connection closed on an error may take to flush before it is aborted (a client
# that stops reading would otherwise keep its socket and buffers).
_ABORT_SECONDS = 5.0
# What a call may hold unread: one message of the largest size and its prefix. Past it (a
# client sending on while its request waits in flow control) the call is refused.
_MAX_UNREAD_BYTES = wire.MAX_MESSAGE_BYTES + 5
_MAX_STREAM_ID = 2**31 - 1
# Announced receive windows: a 200 KB prompt arrives without waiting for a window update.
# What fills them is counted toward --max-buffered-bytes until it is decoded.
_STREAM_WINDOW = 4 * 1024 * 1024
_CONNECTION_WINDOW = 64 * 1024 * 1024
# An answer larger than this goes to the socket in parts, each after a look at its buffer: a
# client that does not read stops it there (pause_writing), not after the whole answer.
_WRITE_CHUNK = 256 * 1024
# A method or content-type echoed in an error: no more than this (HPACK encodes it per call).
_MAX_ECHOED = 128
_KEEPALIVE_PING = b"epp-live"  # PING payloads (8 bytes): keepalive, and the idle close's
_IDLE_PING = b"epp-idle"

# gRPC status codes (grpc/doc/statuscodes.md)
OK, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND = 0, 2, 3, 4, 5
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 8, 12, 13

_CONFIG = H2Configuration(
    client_side=False,
    header_encoding=None,
    # Our own headers are fixed and valid: skip h2's per-send checks. Inbound ones stay checked.
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
)
_RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))


def _frame(message: bytes) -> bytes:
    """gRPC's length-prefixed message: not compressed, then the length (big-endian)."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def _status_headers(code: int, message: str) -> list[tuple[bytes, bytes]]:
    headers = [(b"grpc-status", str(code).encode())]
    if message:
        headers.append((b"grpc-message", _percent_encode(message)))
    return headers


def _percent_encode(text: str) -> bytes:
    """grpc-message's encoding: printable ASCII but ``%`` as is, every other byte as %XX."""
    return b"".join(
        bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
        for b in text.encode("utf-8")
    )


class _CallError(Exception):
    """Ends a call with a gRPC status (the message's own fault, not the server's)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Call:
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
        self, stream_id: int, is_health: bool, session: RequestStream | None, opened_at: float
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


class _Connection(asyncio.Protocol):
    """One client connection: h2's state machine and the calls open on it."""

    def __init__(self, server: H2GrpcServer) -> None:
        self._server = server
        self._processor = server.processor
        self._budget = server.budget
        self._limits = server.limits
        self._h2 = H2Connection(config=_CONFIG)
        self._calls: dict[int, _Call] = {}
        self._blocked: set[_Call] = set()  # calls with data waiting for a window (or the socket)
        self._transport: asyncio.Transport | None = None
        self._refused = False
        self._closed = False
        self._last_stream_id: int | None = None  # set by the final GOAWAY: later ones refused
        self._paused = False  # the socket's write buffer is above its high-water mark
        self._loop = asyncio.get_running_loop()
        self._now = self._last_read = self._active_at = self._loop.time()
        self._pings = PingPolicy(self._limits.min_ping_interval)
        self._resets = ResetPolicy(self._limits.premature_reset_streams)
        # Headers or data sent either way since the last client PING. grpc core counts what it
        # sends, window updates included; h2 sends few of those, and a grpc client's BDP PINGs
        # follow the data it sends: counting only ours would call them strikes.
        self._data_flowed = False
        self._ping_sent: float | None = None  # the keepalive PING not yet answered
        self._idle_goaway_at: float | None = None  # the idle close's first GOAWAY
        self._timer: asyncio.TimerHandle | None = None
        self.lost: asyncio.Future[None] = self._loop.create_future()

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._server.connections.add(self)
        h2 = self._h2
        # Our limits in the first SETTINGS (with update_settings, h2 would hold 100 streams
        # until they are acknowledged). h2 ends the whole connection when a client passes the
        # stream limit; _open refuses that one stream instead (RFC 9113, 5.1.2), so h2 is told
        # of no limit once it has announced ours.
        announced = {
            SettingCodes.MAX_CONCURRENT_STREAMS: self._limits.max_streams_per_connection,
            SettingCodes.INITIAL_WINDOW_SIZE: _STREAM_WINDOW,
            SettingCodes.MAX_HEADER_LIST_SIZE: h2.DEFAULT_MAX_HEADER_LIST_SIZE,
        }
        h2.local_settings = Settings(client=False, initial_values=announced)
        h2.initiate_connection()
        announced[SettingCodes.MAX_CONCURRENT_STREAMS] = _MAX_STREAM_ID
        h2.local_settings = Settings(client=False, initial_values=announced)
        if self._server.stopping:
            # accepted before the listener closed, its TLS handshake done only now: its
            # SETTINGS, then a GOAWAY saying no stream of it was or will be served
            self._refused = True
            self.goaway(last_stream_id=0)
            transport.close()
            return
        h2.increment_flow_control_window(_CONNECTION_WINDOW - 65_535)
        self._flush()
        self._schedule()

    def data_received(self, data: bytes) -> None:
        if self._refused or self._closed:  # a refused connection's handshake, or one ending
            return
        self._now = self._last_read = self._loop.time()
        try:
            events = self._h2.receive_data(data)
        except ProtocolError as exc:
            log.info("ext_proc connection closed on a protocol error", error=clip(str(exc)))
            self._flush()  # h2's GOAWAY
            self.close()
            return
        for event in events:
            self._on_event(event)
            if self._closed:
                return
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        for call in list(self._calls.values()):
            self._drop(call)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._server.connections.discard(self)
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        """The socket's buffer is full (the client is not reading): write no more answers and
        read no more requests until it drains."""
        self._paused = True
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self._transport is None or self._transport.is_closing():
            return
        self._transport.resume_reading()
        self._unblock()
        self._flush()

    # -- events ----------------------------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        if isinstance(event, DataReceived):
            self._data_flowed = True
            call = self._calls.get(event.stream_id)
            if call is None or call.answered:  # dropped unread: consumed
                self._acknowledge(event.stream_id, event.flow_controlled_length)
                return
            call.buffer += event.data
            call.unacked += event.flow_controlled_length
            if not self._hold(call):
                return
            if call.waiting is None:
                self._feed(call)
            elif len(call.buffer) > _MAX_UNREAD_BYTES:
                self._finish(
                    call,
                    RESOURCE_EXHAUSTED,
                    f"more than {_MAX_UNREAD_BYTES} bytes sent before an answer",
                )
            self._settle(call)
        elif isinstance(event, RequestReceived):
            self._data_flowed = True
            if (self._last_stream_id is not None and event.stream_id > self._last_stream_id) or len(
                self._calls
            ) >= self._limits.max_streams_per_connection:
                with contextlib.suppress(ProtocolError):  # not served: the client may retry it
                    self._h2.reset_stream(event.stream_id, ErrorCodes.REFUSED_STREAM)
                return
            self._open(event.stream_id, event.headers, ended=event.stream_ended is not None)
        elif isinstance(event, StreamEnded):  # a DATA or HEADERS frame ended it
            self._data_flowed = True
            call = self._calls.get(event.stream_id)
            if call is not None:
                call.ended = True
                if call.answered:
                    self._send_outbox(call)  # the status it was held for
                elif call.waiting is None:
                    self._end(call)
        elif isinstance(event, StreamReset):
            call = self._calls.get(event.stream_id)
            if call is not None:
                self._reset_by_client(call)
        elif isinstance(event, WindowUpdated):
            if event.stream_id:
                call = self._calls.get(event.stream_id)
                if call is not None and call in self._blocked:
                    self._send_outbox(call)
            else:
                self._unblock()
        elif isinstance(event, PingReceived):  # h2 has queued the ACK
            if self._data_flowed:
                self._data_flowed = False
                self._pings.reset()
            if self._pings.received(self._now):
                self._calm(b"too_many_pings")
        elif isinstance(event, PingAckReceived):
            if event.ping_data == _IDLE_PING:
                self._idle_acknowledged()
            self._ping_sent = None
        elif isinstance(event, RemoteSettingsChanged):
            if SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
                self._unblock()
        elif isinstance(event, ConnectionTerminated):
            # The client's GOAWAY: h2 sends nothing after it, so what is open here ends now.
            self.close()

    def _open(self, stream_id: int, headers: Sequence[tuple[bytes, bytes]], *, ended: bool) -> None:
        path = method = content_type = b""
        timeout: bytes | None = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
        if method != b"POST":  # gRPC is POST only; a plain HTTP answer, as for the next two
            self._refuse(stream_id, ((b":status", b"405"), (b"allow", b"POST")), ended)
            return
        kind = content_type_kind(content_type)
        if kind is ContentType.NOT_GRPC:
            self._refuse(stream_id, ((b":status", b"415"),), ended)
            return
        if kind is ContentType.OTHER_CODEC:
            codec = _echo(content_type)
            self._refuse_call(
                stream_id, UNIMPLEMENTED, f"content-type {codec} is not served", ended
            )
            return
        seconds = None
        if timeout is not None:
            try:
                seconds = parse_grpc_timeout(timeout)
            except ValueError as exc:  # grpc-go's answer to a malformed one
                self._refuse_call(stream_id, INTERNAL, f"malformed grpc-timeout: {exc}", ended)
                return
        if path == PROCESS_PATH:
            call = _Call(stream_id, False, self._processor.open_stream(), self._now)
        elif path == HEALTH_CHECK_PATH:
            call = _Call(stream_id, True, None, self._now)
        else:
            self._refuse_call(stream_id, UNIMPLEMENTED, f"unknown method {_echo(path)}", ended)
            return
        self._calls[stream_id] = call
        self._resets.opened += 1
        if seconds is not None:
            call.deadline = self._loop.call_later(seconds, self._deadline_over, call)

    def _refuse(self, stream_id: int, headers: Sequence[tuple[bytes, bytes]], ended: bool) -> None:
        """Answer a stream that is no call at once, in one HEADERS frame, and ask the client
        to stop sending on it (RFC 9113, 8.1) unless it already has."""
        with contextlib.suppress(ProtocolError):  # the client reset it in the same frames
            self._h2.send_headers(stream_id, headers, end_stream=True)
            if not ended:
                self._h2.reset_stream(stream_id, ErrorCodes.NO_ERROR)

    def _refuse_call(self, stream_id: int, code: int, message: str, ended: bool) -> None:
        self._refuse(stream_id, (*_RESPONSE_HEADERS, *_status_headers(code, message)), ended)

    def _hold(self, call: _Call) -> bool:
        """Count what the call holds undecoded toward the shared body budget; when it does not
        fit, answer the call as a full budget is answered and return False."""
        extra = len(call.buffer) - call.held
        if extra <= 0 or self._budget.try_reserve(extra):
            call.held += max(extra, 0)
            return True
        self._let_go(call)
        if call.is_health:
            self._finish(call, RESOURCE_EXHAUSTED, "the endpoint picker is holding too much")
        else:
            self._answer(call, (self._processor.budget_refusal(),))
            self._finish(call, OK)
        self._settle(call)
        return False

    def _let_go(self, call: _Call) -> None:
        """Forget what the call holds undecoded and give its bytes back to the budget."""
        call.buffer.clear()
        self._budget.release(call.held)
        call.held = 0

    def _settle(self, call: _Call) -> None:
        """Acknowledge what the call consumed: everything received, unless it waits in flow
        control (what came meanwhile is read when the wait ends)."""
        if call.unacked and (call.waiting is None or call.answered):
            self._acknowledge(call.stream_id, call.unacked)
            call.unacked = 0

    def _acknowledge(self, stream_id: int, size: int) -> None:
        if size:
            with contextlib.suppress(ProtocolError):  # the connection is closing
                self._h2.acknowledge_received_data(size, stream_id)

    def _feed(self, call: _Call) -> None:
        """Answer every complete message received, in order, until the call waits in flow
        control or is answered."""
        while not call.answered and call.waiting is None:
            try:
                message = self._next_message(call)
            except _CallError as exc:
                self._finish(call, exc.code, exc.message)
                return
            if message is None:
                return
            if call.is_health:
                self._check(call, message)
            elif call.session is None:  # refused at the open-streams limit
                self._answer(call, (self._processor.refusal(),))
                self._finish(call, OK)
            else:
                self._process(call, call.session, message)

    def _end(self, call: _Call) -> None:
        """The client ended its side with every message answered."""
        if call.is_health:
            self._finish(call, INVALID_ARGUMENT, "a health check needs a request message")
        elif call.buffer:
            self._finish(call, INTERNAL, "the stream ended inside a message")
        else:
            self._finish(call, OK)

    def _next_message(self, call: _Call) -> bytes | None:
        buffer = call.buffer
        if len(buffer) < 5:
            return None
        if buffer[0]:
            raise _CallError(UNIMPLEMENTED, "compressed messages are not supported")
        size = int.from_bytes(buffer[1:5], "big")
        if size > wire.MAX_MESSAGE_BYTES:
            raise _CallError(
                RESOURCE_EXHAUSTED,
                f"a message of {size} bytes exceeds the limit of {wire.MAX_MESSAGE_BYTES}",
            )
        if len(buffer) < 5 + size:
            return None
        message = bytes(buffer[5 : 5 + size])
        del buffer[: 5 + size]
        call.held -= 5 + size
        self._budget.release(5 + size)
        return message

    def _process(self, call: _Call, session: RequestStream, raw: bytes) -> None:
        try:
            message = pb.ProcessingRequest.FromString(raw)
        except DecodeError:
            self._finish(call, INTERNAL, "the message is not a ProcessingRequest")
            return
        try:
            out = session.handle(message)
        except Exception:  # RequestStream answers its own errors; this is a bug
            log.exception("ext_proc stream failed", request_id=session.request_id)
            self._finish(call, UNKNOWN, "internal error in the endpoint picker")
            return
        if session.queued:  # flow control holds the request until the pool has room
            call.waiting = self._loop.create_task(self._wait(call, session))
            return
        self._answer(call, out)
        if session.finished:
            self._finish(call, OK)

    async def _wait(self, call: _Call, session: RequestStream) -> None:
        try:
            out = await session.resume()
        except Exception:
            log.exception("ext_proc stream failed", request_id=session.request_id)
            self._finish(call, UNKNOWN, "internal error in the endpoint picker")
        else:
            self._answer(call, out)
            if session.finished:
                self._finish(call, OK)
        call.waiting = None
        self._feed(call)  # what arrived meanwhile
        if call.ended and not call.answered:  # a dropped call is answered too
            self._end(call)
        self._settle(call)
        self._flush()

    def _check(self, call: _Call, raw: bytes) -> None:
        try:
            request = health_pb2.HealthCheckRequest.FromString(raw)
        except DecodeError:
            self._finish(call, INTERNAL, "the message is not a HealthCheckRequest")
            return
        status = self._server.health.status(request.service)
        if status is None:
            self._finish(call, NOT_FOUND, f"unknown service {_echo(request.service.encode())}")
            return
        self._answer(call, (health_pb2.HealthCheckResponse(status=status),))
        self._finish(call, OK)

    def _deadline_over(self, call: _Call) -> None:
        """The client's grpc-timeout has passed: end the call now, what was not sent dropped."""
        call.deadline = None
        if self._calls.get(call.stream_id) is not call or call.answered:
            return
        call.outbox.clear()
        self._finish(call, DEADLINE_EXCEEDED, "deadline exceeded", rest=False)
        self._settle(call)
        self._flush()

    # -- sending ---------------------------------------------------------------------------------

    def _answer(self, call: _Call, messages: Sequence[pb.ProcessingResponse]) -> None:
        if not messages:
            return
        self._data_flowed = True
        try:
            if not call.headers_sent:
                self._h2.send_headers(call.stream_id, _RESPONSE_HEADERS)
                call.headers_sent = True
            # one DATA frame for the answer's messages (a routing answer has two), not one each
            framed = b"".join(_frame(message.SerializeToString()) for message in messages)
            call.outbox.append(memoryview(framed))
            self._send_outbox(call)
        except ProtocolError:  # the client reset the stream in the frames just read
            self._reset_by_client(call)

    def _finish(self, call: _Call, code: int, message: str = "", *, rest: bool = True) -> None:
        """End the session and answer the call with its status, once the client has ended its
        side (a gRPC client writing its request still would fail on an early status) or after
        ``CLIENT_REST_SECONDS`` (at once without ``rest``); what the client still sends
        meanwhile is dropped."""
        if call.answered:
            return
        call.answered = True
        self._let_go(call)
        self._end_session(call)
        trailers = _status_headers(code, message)
        if not call.headers_sent:  # trailers only
            trailers = [*_RESPONSE_HEADERS, *trailers]
            call.headers_sent = True
        call.trailers = trailers
        if call.ended or not rest:
            self._send_outbox(call)
        else:
            call.rest_timer = self._loop.call_later(CLIENT_REST_SECONDS, self._rest_over, call)

    def _send_outbox(self, call: _Call) -> None:
        """Send what the client's windows and the socket allow, then the status once it is
        due; a call whose status is sent is forgotten."""
        if self._paused:
            self._blocked.add(call)
            return
        h2 = self._h2
        stream_id = call.stream_id
        outbox = call.outbox
        written = 0
        self._data_flowed = True  # data or trailers go out (a client's next PING is not a strike)
        try:
            while outbox:
                data = outbox[0]
                size = min(h2.local_flow_control_window(stream_id), h2.max_outbound_frame_size)
                if size <= 0:
                    self._blocked.add(call)
                    return
                if len(data) <= size:
                    h2.send_data(stream_id, data)
                    outbox.pop(0)
                else:
                    h2.send_data(stream_id, data[:size])
                    outbox[0] = data[size:]
                written += size
                if written >= _WRITE_CHUNK:
                    written = 0
                    self._flush()  # may pause writing
                    if self._paused:
                        self._blocked.add(call)
                        return
            self._blocked.discard(call)
            if call.trailers is None or not (call.ended or call.rest_timer is None):
                return  # no status yet, or held for the client's end
            h2.send_headers(stream_id, call.trailers, end_stream=True)
            call.trailers = None
            if not call.ended:  # its rest is over: ask the client to stop sending
                h2.reset_stream(stream_id, ErrorCodes.NO_ERROR)
        except ProtocolError:  # the client reset the stream in the frames just read
            self._reset_by_client(call)
            return
        self._forget(call)

    def _unblock(self) -> None:
        """A window opened for the whole connection, or the socket drained: send what waited."""
        for call in list(self._blocked):
            self._send_outbox(call)

    def _rest_over(self, call: _Call) -> None:
        call.rest_timer = None
        if self._calls.get(call.stream_id) is call and not call.ended:
            self._send_outbox(call)
            self._flush()

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    # -- endings ---------------------------------------------------------------------------------

    def _end_session(self, call: _Call) -> None:
        session, call.session = call.session, None
        waiting, call.waiting = call.waiting, None
        if waiting is not None and waiting is not asyncio.current_task():
            # Cancel the wait first, close the session once it has ended: a request that flow
            # control admitted in this same turn is routed as the wait ends, and only the
            # close after that finishes it (its in-flight count).
            waiting.cancel()
            cancelled = self._server.cancelled
            cancelled.add(waiting)
            processor = self._processor

            def closed(task: asyncio.Task[None]) -> None:
                cancelled.discard(task)
                if session is not None:
                    processor.close_stream(session)

            waiting.add_done_callback(closed)
        elif session is not None:
            self._processor.close_stream(session)

    def _forget(self, call: _Call) -> None:
        calls = self._calls
        if calls.get(call.stream_id) is call:
            del calls[call.stream_id]
            if not calls:
                self._went_idle()
        self._blocked.discard(call)
        if call.rest_timer is not None:
            call.rest_timer.cancel()
            call.rest_timer = None
        if call.deadline is not None:
            call.deadline.cancel()
            call.deadline = None

    def _drop(self, call: _Call) -> None:
        """The stream is gone (reset, or its connection): free what it holds, answer nothing."""
        call.answered = True
        call.outbox.clear()
        call.trailers = None
        self._let_go(call)
        self._acknowledge(call.stream_id, call.unacked)
        call.unacked = 0
        self._end_session(call)
        self._forget(call)

    def _reset_by_client(self, call: _Call) -> None:
        """The client reset the stream: drop it, and count it when it was reset unanswered
        right after it was opened (h2 may report the reset before its event, as sending
        fails)."""
        premature = not call.answered and self._resets.reset(self._now - call.opened_at)
        self._drop(call)
        if premature:
            self._calm(b"too_many_resets", streams=self._resets.opened)

    def _calm(self, reason: bytes, **fields: int) -> None:
        """The client abuses the connection (grpc core's answer): GOAWAY ENHANCE_YOUR_CALM
        naming ``reason``, then the close, which ends every call on it."""
        log.warning(
            "ext_proc connection closed: ENHANCE_YOUR_CALM", reason=reason.decode(), **fields
        )
        self._h2.data_to_send()  # what this read queued (its PING ACKs too) is not sent
        with contextlib.suppress(ProtocolError):
            self._h2.close_connection(
                ErrorCodes.ENHANCE_YOUR_CALM, reason, self._h2.highest_inbound_stream_id
            )
        self._flush()
        self.close()

    # -- keepalive and idleness --------------------------------------------------------------------

    def _schedule(self) -> None:
        """Arm the one timer of the connection for its next keepalive or idleness check."""
        limits = self._limits
        dues = []
        if self._ping_sent is not None:
            dues.append(self._ping_sent + limits.keepalive_timeout)
        elif limits.keepalive_time:
            dues.append(self._last_read + limits.keepalive_time)
        if self._idle_goaway_at is not None:
            dues.append(self._idle_goaway_at + (limits.keepalive_timeout or 1.0))
        elif limits.max_connection_idle and not self._calls:
            dues.append(self._active_at + limits.max_connection_idle)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if dues:
            self._timer = self._loop.call_at(min(dues), self._tick)

    def _went_idle(self) -> None:
        """The last call ended: the idle clock starts (the timer may now be due sooner)."""
        if self._closed:
            return
        self._active_at = self._now = self._loop.time()
        if self._limits.max_connection_idle and self._idle_goaway_at is None:
            timer = self._timer
            due = self._active_at + self._limits.max_connection_idle
            if timer is None or timer.when() > due:
                self._schedule()
        elif self._idle_goaway_at is not None and self._last_stream_id is not None:
            self.close()  # the idle close's final GOAWAY was sent, its last stream is done

    def _tick(self) -> None:
        self._timer = None
        if self._closed or self._transport is None or self._transport.is_closing():
            return
        limits = self._limits
        now = self._now = self._loop.time()
        if self._ping_sent is not None and self._last_read > self._ping_sent:
            self._ping_sent = None  # something arrived since: alive
        if self._ping_sent is not None and now >= self._ping_sent + limits.keepalive_timeout:
            log.info(
                "ext_proc connection closed: its client answered no keepalive PING",
                calls=len(self._calls),
                seconds=round(now - self._last_read, 1),
            )
            self.close(abort=True)
            return
        if self._idle_goaway_at is not None:
            if now >= self._idle_goaway_at + (limits.keepalive_timeout or 1.0):
                self._idle_acknowledged()  # no PING answer: close anyway
                if self._closed:
                    return
        elif (
            limits.max_connection_idle
            and not self._calls
            and now >= self._active_at + limits.max_connection_idle
        ):
            self._close_idle()
        if (
            limits.keepalive_time
            and self._ping_sent is None
            and now >= self._last_read + limits.keepalive_time
        ):
            self._ping(_KEEPALIVE_PING)
            self._ping_sent = now
        self._schedule()

    def _ping(self, data: bytes) -> None:
        with contextlib.suppress(ProtocolError):
            self._h2.ping(data)
        self._flush()

    def _close_idle(self) -> None:
        """grpc's graceful close of an idle connection: a GOAWAY that still lets streams in
        and a PING; once the PING is answered (the client has seen the GOAWAY), a final one
        naming the last stream, and the close when no call is left."""
        log.info("ext_proc connection idle: closing", idle_seconds=self._limits.max_connection_idle)
        self._idle_goaway_at = self._now
        self.goaway()
        self._ping(_IDLE_PING)

    def _idle_acknowledged(self) -> None:
        if self._idle_goaway_at is None or self._last_stream_id is not None:
            return
        self.last_goaway()
        if not self._calls:
            self.close()

    # -- drain -----------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a call is still being answered (its status included)."""
        return any(
            not call.answered or call.outbox or call.trailers is not None
            for call in self._calls.values()
        )

    def goaway(self, last_stream_id: int = _MAX_STREAM_ID) -> None:
        """HTTP/2's graceful shutdown: no new streams, the open ones (up to
        ``last_stream_id``) go on (RFC 9113, 6.8)."""
        if self._transport is None or self._transport.is_closing():
            return
        frame = GoAwayFrame(0)
        frame.last_stream_id = last_stream_id
        frame.error_code = 0
        self._flush()  # what h2 has queued goes first
        self._transport.write(frame.serialize())

    def last_goaway(self) -> None:
        """The drain's second GOAWAY (RFC 9113, 6.8): it names the last stream received, and
        streams the client opens after it are refused."""
        self._last_stream_id = self._h2.highest_inbound_stream_id
        self.goaway(self._last_stream_id)

    def cancel(self) -> None:
        """Past the grace: close the connection, which ends every call still open on it (the
        client sees them reset); their sessions end now. What the client has not read is
        dropped."""
        transport = self._transport
        self.close()
        if transport is not None and transport.get_write_buffer_size():
            transport.abort()

    def close(self, *, abort: bool = False) -> None:
        """End every call now and close, at once with ``abort`` (a peer that answers nothing),
        else aborting if the client does not read what is left within ``_ABORT_SECONDS``."""
        self._closed = True
        for call in list(self._calls.values()):
            self._drop(call)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if abort:
            transport.abort()
            return
        transport.close()
        if transport.get_write_buffer_size():
            self._loop.call_later(_ABORT_SECONDS, transport.abort)


def _echo(value: bytes) -> str:
    """A client's value as an error message quotes it: decoded, and cut."""
    return clip(value.decode("utf-8", "replace"), _MAX_ECHOED)


class H2GrpcServer:
    """The h2 ext_proc server: ``start`` binds and listens, ``stop(grace)`` drains."""

    def __init__(
        self,
        processor: ExternalProcessor,
        health: HealthState,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        *,
        reuse_port: bool = False,
        budget: BodyBudget | None = None,
        limits: GrpcConnectionSettings | None = None,
    ) -> None:
        self.processor = processor
        self.health = health
        # the process's body budget: calls count their undecoded bytes toward it
        self.budget = budget or BodyBudget(0)
        self.limits = (limits or GrpcConnectionSettings()).resolved(0)
        self.connections: weakref.WeakSet[_Connection] = weakref.WeakSet()
        self.cancelled: set[asyncio.Task[None]] = set()  # flow-control waits being cancelled
        self.stopping = False
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self._reuse_port = reuse_port
        self._listener: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        """Bind and listen; raises ``OSError`` when the address cannot be bound."""
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            lambda: _Connection(self),
            self._host or None,
            self._port,
            ssl=self._ssl,
            reuse_address=True,
            # A port in use fails loudly unless this is a worker of one parent (which holds it).
            reuse_port=self._reuse_port,
        )
        self.port = int(self._listener.sockets[0].getsockname()[1])

    async def stop(self, grace: float | None) -> None:
        """Refuse new connections and streams, let open calls finish within ``grace`` seconds
        (None: wait for them), then reset what is left and close every connection."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        self.stopping = True
        listener.close()
        for connection in list(self.connections):
            connection.goaway()
        deadline = None if grace is None else time.monotonic() + grace
        while any(connection.busy for connection in list(self.connections)):
            if deadline is not None and time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.02)
        if self.connections:
            for connection in list(self.connections):
                connection.last_goaway()
            await asyncio.sleep(_LAST_GOAWAY_SECONDS)
        for connection in list(self.connections):
            connection.cancel()
        lost = [connection.lost for connection in self.connections]
        if lost:  # each socket closes on the loop's next turn
            await asyncio.wait(lost, timeout=_CLOSE_SECONDS)
        if self.cancelled:
            _, pending = await asyncio.wait(self.cancelled, timeout=_CLOSE_SECONDS)
            if pending:
                log.warning("ext_proc calls still waiting after stop", calls=len(pending))
