"""One client connection of the h2 ext_proc server: the reading half (h2's events, calls opened,
messages decoded and handed to their sessions, health checks) on the writing half
(``h2writer.CallWriter``), its keepalive (``h2keepalive``) and its part of the drain."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
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

from endpoint_picker.errors import clip
from endpoint_picker.extproc.h2calls import (
    DEADLINE_EXCEEDED,
    HEALTH_CHECK_PATH,
    INTERNAL,
    INVALID_ARGUMENT,
    MAX_STREAM_ID,
    NOT_FOUND,
    OK,
    PROCESS_PATH,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    UNKNOWN,
    Call,
    CallError,
    Host,
    echo,
    next_message,
)
from endpoint_picker.extproc.h2policy import (
    ContentType,
    PingPolicy,
    content_type_kind,
    parse_grpc_timeout,
)
from endpoint_picker.extproc.h2writer import CallWriter
from endpoint_picker.extproc.session import Session

log = structlog.get_logger(__name__)

# Announced receive windows: a 200 KB prompt arrives without waiting for a window update.
# What fills them is counted toward --max-buffered-bytes until it is decoded.
STREAM_WINDOW = 4 * 1024 * 1024
CONNECTION_WINDOW = 64 * 1024 * 1024


class Connection(CallWriter, asyncio.Protocol):
    """One client connection: h2's state machine and the calls open on it."""

    def __init__(self, server: Host) -> None:
        super().__init__(server)
        self._refused = False
        self._pings = PingPolicy(self._limits.min_ping_interval)
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
            SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            SettingCodes.MAX_HEADER_LIST_SIZE: h2.DEFAULT_MAX_HEADER_LIST_SIZE,
        }
        h2.local_settings = Settings(client=False, initial_values=announced)
        h2.initiate_connection()
        announced[SettingCodes.MAX_CONCURRENT_STREAMS] = MAX_STREAM_ID
        h2.local_settings = Settings(client=False, initial_values=announced)
        if self._server.stopping:
            # accepted before the listener closed, its TLS handshake done only now: its
            # SETTINGS, then a GOAWAY saying no stream of it was or will be served
            self._refused = True
            self.goaway(last_stream_id=0)
            transport.close()
            return
        h2.increment_flow_control_window(CONNECTION_WINDOW - 65_535)
        self._flush()
        self._keepalive.schedule()

    def data_received(self, data: bytes) -> None:
        if self._refused or self._closed:  # a refused connection's handshake, or one ending
            return
        self.now = self._keepalive.last_read = self._loop.time()
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
        self._keepalive.stop()
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
            elif len(call.buffer) > self._server.max_unread_bytes:
                self._finish(
                    call,
                    RESOURCE_EXHAUSTED,
                    f"more than {self._server.max_unread_bytes} bytes sent before an answer",
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
            if self._pings.received(self.now):
                self._calm(b"too_many_pings")
        elif isinstance(event, PingAckReceived):
            self._keepalive.ping_acknowledged(event.ping_data)
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
        # the exact type every gRPC client sends, without a parse
        grpc = content_type == b"application/grpc"
        kind = ContentType.GRPC if grpc else content_type_kind(content_type)
        if kind is ContentType.NOT_GRPC:
            self._refuse(stream_id, ((b":status", b"415"),), ended)
            return
        if kind is ContentType.OTHER_CODEC:
            codec = echo(content_type)
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
            call = Call(stream_id, False, self._processor.open_stream(), self.now)
        elif path == HEALTH_CHECK_PATH:
            call = Call(stream_id, True, None, self.now)
        else:
            self._refuse_call(stream_id, UNIMPLEMENTED, f"unknown method {echo(path)}", ended)
            return
        self._calls[stream_id] = call
        self._resets.opened += 1
        if seconds is not None:
            call.deadline = self._loop.call_later(seconds, self._deadline_over, call)

    def _hold(self, call: Call) -> bool:
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

    def _settle(self, call: Call) -> None:
        """Acknowledge what the call consumed: everything received, unless it waits in flow
        control (what came meanwhile is read when the wait ends)."""
        if call.unacked and (call.waiting is None or call.answered):
            self._acknowledge(call.stream_id, call.unacked)
            call.unacked = 0

    def _feed(self, call: Call) -> None:
        """Answer every complete message received, in order, until the call waits in flow
        control or is answered."""
        while not call.answered and call.waiting is None:
            try:
                message = next_message(call, self._budget)
            except CallError as exc:
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

    def _end(self, call: Call) -> None:
        """The client ended its side with every message answered."""
        if call.is_health:
            self._finish(call, INVALID_ARGUMENT, "a health check needs a request message")
        elif call.buffer:
            self._finish(call, INTERNAL, "the stream ended inside a message")
        else:
            self._finish(call, OK)

    def _process(self, call: Call, session: Session, raw: bytes) -> None:
        try:
            message = pb.ProcessingRequest.FromString(raw)
        except DecodeError:
            self._finish(call, INTERNAL, "the message is not a ProcessingRequest")
            return
        try:
            out = session.handle(message)
        except Exception:  # Session answers its own errors; this is a bug
            log.exception("ext_proc stream failed", request_id=session.request_id)
            self._finish(call, UNKNOWN, "internal error in the endpoint picker")
            return
        if session.queued:  # flow control holds the request until the pool has room
            call.waiting = self._loop.create_task(self._wait(call, session))
            return
        self._answer(call, out)
        if session.finished:
            self._finish(call, OK)

    async def _wait(self, call: Call, session: Session) -> None:
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

    def _check(self, call: Call, raw: bytes) -> None:
        try:
            request = health_pb2.HealthCheckRequest.FromString(raw)
        except DecodeError:
            self._finish(call, INTERNAL, "the message is not a HealthCheckRequest")
            return
        status = self._server.health.status(request.service)
        if status is None:
            self._finish(call, NOT_FOUND, f"unknown service {echo(request.service.encode())}")
            return
        self._answer(call, (health_pb2.HealthCheckResponse(status=status),))
        self._finish(call, OK)

    def _deadline_over(self, call: Call) -> None:
        """The client's grpc-timeout has passed: end the call now, what was not sent dropped."""
        call.deadline = None
        if self._calls.get(call.stream_id) is not call or call.answered:
            return
        call.outbox.clear()
        self._finish(call, DEADLINE_EXCEEDED, "deadline exceeded", rest=False)
        self._settle(call)
        self._flush()
