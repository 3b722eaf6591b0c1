"""What both ext_proc servers share: one session per ``Process`` call, whatever the transport.

A session is the stream state machine (``stream.RequestStream``, or a test's double): the
server hands it each ``ProcessingRequest`` and sends back what it returns; when it says the
request waits in flow control, the server awaits ``resume()`` before reading on. Around it, the
process-wide admission limits (``limits``): a stream slot per open call (past
``--max-concurrent-streams``: the JSON 429 of ``refusal``) and the body budget that the h2
server's undecoded bytes count toward too (full: ``budget_refusal``). Both are answered as a JSON
429 on the call's first message, not with gRPC's RESOURCE_EXHAUSTED, which would reach the client
as Envoy's empty 500.

The servers (``h2grpc`` on h2, ``grpcio_server`` on grpcio) are peers on this module; neither
imports the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from endpoint_picker.errors import ErrorCode
from endpoint_picker.extproc import messages
from endpoint_picker.extproc.limits import BUDGET_FULL, StreamSlots
from endpoint_picker.telemetry.metrics import EppMetrics

log = structlog.get_logger(__name__)

# What a stream refused at --max-concurrent-streams is told (a 429: it may be retried).
STREAMS_FULL = "the endpoint picker has too many open requests; retry later"

Responses = list[pb.ProcessingResponse]


class Session(Protocol):
    """One ext_proc stream as a server drives it (``stream.RequestStream``)."""

    @property
    def finished(self) -> bool:
        """The request is answered for good: the server ends the call."""

    @property
    def queued(self) -> bool:
        """The last ``handle`` left the request waiting in flow control: await ``resume``."""

    @property
    def request_id(self) -> str: ...

    def handle(self, message: pb.ProcessingRequest) -> Responses: ...

    async def resume(self) -> Responses: ...

    def close(self) -> None: ...


class ExternalProcessor:
    """Opens and closes sessions against the process's stream slots, and answers the calls the
    limits refuse. One per process, shared by every connection of either server."""

    def __init__(
        self,
        new_stream: Callable[[], Session],
        slots: StreamSlots | None = None,
        metrics: EppMetrics | None = None,
    ) -> None:
        self._new_stream = new_stream  # the composition root binds the stream's dependencies
        self._slots = slots or StreamSlots(0)
        self._metrics = metrics

    def open_stream(self) -> Session | None:
        """A new stream's session, or None when ``--max-concurrent-streams`` refuses it
        (counted and logged here; answer its first message with ``refusal()``).
        ``close_stream`` ends a session this returned."""
        stream = self._new_stream()
        if self._slots.try_acquire():
            return stream
        stream.close()
        log.debug("ext_proc stream refused", open_streams=self._slots.open)
        if self._metrics is not None:
            self._metrics.stream_limit_rejections.inc()
            self._metrics.request_failed("", "", ErrorCode.RESOURCE_EXHAUSTED)
        return None

    def close_stream(self, stream: Session) -> None:
        self._slots.release()
        stream.close()

    def budget_refusal(self) -> pb.ProcessingResponse:
        """The answer to a call whose undecoded message does not fit ``--max-buffered-bytes``
        (the h2 stack counts them): the JSON 429 of a full body budget, counted as it is."""
        if self._metrics is not None:
            self._metrics.buffer_budget_rejections.inc()
            self._metrics.request_failed("", "", ErrorCode.RESOURCE_EXHAUSTED)
        return messages.immediate_error(ErrorCode.RESOURCE_EXHAUSTED, BUDGET_FULL)

    @staticmethod
    def refusal() -> pb.ProcessingResponse:
        """The answer to the first message of a stream ``open_stream`` refused."""
        return messages.immediate_error(ErrorCode.RESOURCE_EXHAUSTED, STREAMS_FULL)

    @staticmethod
    async def answer(session: Session, message: pb.ProcessingRequest) -> Responses:
        """What ``session`` answers ``message``, after its flow-control wait if it has one
        (cancelling this takes the request out of the queue)."""
        out = session.handle(message)
        if session.queued:  # flow control holds the request until the pool has room
            out = await session.resume()
        return out
