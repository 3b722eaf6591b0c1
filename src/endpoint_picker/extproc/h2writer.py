"""The writing half of an h2 ext_proc connection: answers and statuses sent as the client's
windows and the socket allow, and the ends of calls (what they hold given back, their sessions
closed). ``h2connection.Connection`` adds the reading half on top of it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.exceptions import ProtocolError
from hyperframe.frame import GoAwayFrame

from endpoint_picker.extproc.h2calls import (
    CLIENT_REST_SECONDS,
    H2_CONFIG,
    MAX_STREAM_ID,
    RESPONSE_HEADERS,
    Call,
    Host,
    frame,
    status_headers,
)
from endpoint_picker.extproc.h2keepalive import Keepalive
from endpoint_picker.extproc.h2policy import ResetPolicy

log = structlog.get_logger(__name__)

# An answer larger than this goes to the socket in parts, each after a look at its buffer: a
# client that does not read stops it there (pause_writing), not after the whole answer.
_WRITE_CHUNK = 256 * 1024
# How long a connection closed on an error may take to flush before it is aborted (a client
# that stops reading would otherwise keep its socket and buffers).
_ABORT_SECONDS = 5.0


class CallWriter:
    """A connection's h2 state machine, its calls, and everything that sends on them."""

    def __init__(self, server: Host) -> None:
        self._server = server
        self._processor = server.processor
        self._budget = server.budget
        self._limits = server.limits
        self._h2 = H2Connection(config=H2_CONFIG)
        self._calls: dict[int, Call] = {}
        self._blocked: set[Call] = set()  # calls with data waiting for a window (or the socket)
        self._transport: asyncio.Transport | None = None
        self._closed = False
        self._paused = False  # the socket's write buffer is above its high-water mark
        self._last_stream_id: int | None = None  # set by the final GOAWAY: later ones refused
        self._loop = asyncio.get_running_loop()
        self.now = self._loop.time()  # as of the last read (or keepalive tick)
        self._resets = ResetPolicy(self._limits.premature_reset_streams)
        # Headers or data sent either way since the last client PING. grpc core counts what it
        # sends, window updates included; h2 sends few of those, and a grpc client's BDP PINGs
        # follow the data it sends: counting only ours would call them strikes.
        self._data_flowed = False
        self._keepalive = Keepalive(self, self._limits, self._loop)

    # -- what the keepalive sees (``h2keepalive.Peer``) ------------------------------------------

    @property
    def calls(self) -> int:
        return len(self._calls)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def closing(self) -> bool:
        return self._closed or self._transport is None or self._transport.is_closing()

    @property
    def drained(self) -> bool:
        return self._last_stream_id is not None

    def ping(self, data: bytes) -> None:
        with contextlib.suppress(ProtocolError):
            self._h2.ping(data)
        self._flush()

    # -- sending ---------------------------------------------------------------------------------

    def _answer(self, call: Call, messages: Sequence[pb.ProcessingResponse]) -> None:
        if not messages:
            return
        self._data_flowed = True
        try:
            if not call.headers_sent:
                self._h2.send_headers(call.stream_id, RESPONSE_HEADERS)
                call.headers_sent = True
            # one DATA frame for the answer's messages (a routing answer has two), not one each
            framed = b"".join(frame(message.SerializeToString()) for message in messages)
            call.outbox.append(memoryview(framed))
            self._send_outbox(call)
        except ProtocolError:  # the client reset the stream in the frames just read
            self._reset_by_client(call)

    def _finish(self, call: Call, code: int, message: str = "", *, rest: bool = True) -> None:
        """End the session and answer the call with its status, once the client has ended its
        side (a gRPC client writing its request still would fail on an early status) or after
        ``CLIENT_REST_SECONDS`` (at once without ``rest``); what the client still sends
        meanwhile is dropped."""
        if call.answered:
            return
        call.answered = True
        self._let_go(call)
        self._end_session(call)
        trailers = status_headers(code, message)
        if not call.headers_sent:  # trailers only
            trailers = [*RESPONSE_HEADERS, *trailers]
            call.headers_sent = True
        call.trailers = trailers
        if call.ended or not rest:
            self._send_outbox(call)
        else:
            call.rest_timer = self._loop.call_later(CLIENT_REST_SECONDS, self._rest_over, call)

    def _send_outbox(self, call: Call) -> None:
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

    def _rest_over(self, call: Call) -> None:
        call.rest_timer = None
        if self._calls.get(call.stream_id) is call and not call.ended:
            self._send_outbox(call)
            self._flush()

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _let_go(self, call: Call) -> None:
        """Forget what the call holds undecoded and give its bytes back to the budget."""
        call.buffer.clear()
        self._budget.release(call.held)
        call.held = 0

    def _acknowledge(self, stream_id: int, size: int) -> None:
        if size:
            with contextlib.suppress(ProtocolError):  # the connection is closing
                self._h2.acknowledge_received_data(size, stream_id)

    # -- endings ---------------------------------------------------------------------------------

    def _end_session(self, call: Call) -> None:
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

    def _forget(self, call: Call) -> None:
        calls = self._calls
        if calls.get(call.stream_id) is call:
            del calls[call.stream_id]
            if not calls and not self._closed:
                self._keepalive.went_idle()
        self._blocked.discard(call)
        if call.rest_timer is not None:
            call.rest_timer.cancel()
            call.rest_timer = None
        if call.deadline is not None:
            call.deadline.cancel()
            call.deadline = None

    def _drop(self, call: Call) -> None:
        """The stream is gone (reset, or its connection): free what it holds, answer nothing."""
        call.answered = True
        call.outbox.clear()
        call.trailers = None
        self._let_go(call)
        self._acknowledge(call.stream_id, call.unacked)
        call.unacked = 0
        self._end_session(call)
        self._forget(call)

    def _reset_by_client(self, call: Call) -> None:
        """The client reset the stream: drop it, and count it when it was reset unanswered
        right after it was opened (h2 may report the reset before its event, as sending
        fails)."""
        premature = not call.answered and self._resets.reset(self.now - call.opened_at)
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

    def _refuse(self, stream_id: int, headers: Sequence[tuple[bytes, bytes]], ended: bool) -> None:
        """Answer a stream that is no call at once, in one HEADERS frame, and ask the client
        to stop sending on it (RFC 9113, 8.1) unless it already has."""
        with contextlib.suppress(ProtocolError):  # the client reset it in the same frames
            self._h2.send_headers(stream_id, headers, end_stream=True)
            if not ended:
                self._h2.reset_stream(stream_id, ErrorCodes.NO_ERROR)

    def _refuse_call(self, stream_id: int, code: int, message: str, ended: bool) -> None:
        self._refuse(stream_id, (*RESPONSE_HEADERS, *status_headers(code, message)), ended)

    # -- drain -----------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a call is still being answered (its status included)."""
        return any(
            not call.answered or call.outbox or call.trailers is not None
            for call in self._calls.values()
        )

    def goaway(self, last_stream_id: int = MAX_STREAM_ID) -> None:
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
        self._keepalive.stop()
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if abort:
            transport.abort()
            return
        transport.close()
        if transport.get_write_buffer_size():
            self._loop.call_later(_ABORT_SECONDS, transport.abort)
