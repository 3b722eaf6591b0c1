"""One ext_proc stream = one HTTP request: the state machine that answers Envoy's messages.

Request path, FULL_DUPLEX_STREAMED (the reference configuration): say nothing on the headers,
buffer the body until ``end_of_stream``, then answer the headers (routing mutation + dynamic
metadata) and stream the body back in chunks. BUFFERED: continue the headers at once and put
the routing on the body response. Response path: every chunk goes back at once, unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from endpoint_picker.director import Director
from endpoint_picker.errors import (
    ErrorCode,
    HeadersTooLargeError,
    InternalError,
    PayloadTooLargeError,
    RequestError,
    TooManyRequestsError,
    clip,
)
from endpoint_picker.exchange import SESSION_TOKEN_HEADER, Exchange, QueuedRoute, RoutingDecision
from endpoint_picker.extproc import messages, wire
from endpoint_picker.extproc.limits import BodyBudget
from endpoint_picker.telemetry.metrics import MODEL_SERVER_ERROR, EppMetrics

log = structlog.get_logger(__name__)

_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
BUFFERED = _Mode.BUFFERED
STREAMED = _Mode.STREAMED
_MODE_NAMES = {v: k for k, v in _Mode.BodySendMode.items()}

Responses = list[pb.ProcessingResponse]


_MAX_REQUEST_ID = 128
_MAX_ERROR_MESSAGE = 1000
_MAX_SCHEDULER_HEADER = 256  # a session id or token longer than this is cut
# Envoy's defaults (max_headers_count, max_request_headers_kb); the shipped configs give Envoy
# more, so the EPP's 431 comes before Envoy's empty answer.
DEFAULT_MAX_HEADERS = 100
DEFAULT_MAX_HEADER_BYTES = 60 * 1024
# what the EPP may add: x-gateway-destination-endpoint with a few fallbacks, content-length
_ADDED_HEADER_BYTES = 512


def _safe_request_id(raw: str) -> str:
    """The client's request id as logged: printable ASCII, bounded, or "" (none usable)."""
    text = raw[:_MAX_REQUEST_ID]
    return text if text.isascii() and text.isprintable() else ""


class RequestStream:
    """The per-stream state; ``handle`` returns the responses owed for one message."""

    def __init__(
        self,
        director: Director,
        metrics: EppMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_body_bytes: int = 32 * 1024 * 1024,
        budget: BodyBudget | None = None,
        max_headers: int = DEFAULT_MAX_HEADERS,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        on_reject: Callable[[str, str, str, ErrorCode, str], None] | None = None,
    ) -> None:
        self._director = director
        self._on_reject = on_reject  # (request id, model, target model, code, message): status
        self._max_headers = max_headers
        self._max_header_bytes = max_header_bytes
        self._max_body_bytes = max_body_bytes
        # shared by every stream of the process; this stream holds len(self._body) of it
        self._budget = budget or BodyBudget(0)
        self._metrics = metrics
        self._clock = clock
        self.finished = False
        self._request_mode = FULL_DUPLEX
        self._response_mode = FULL_DUPLEX
        # The request's way through the director (``Director.on_headers``), keyed by the
        # EPP's own id. The client's x-request-id, which any client may repeat, is only logged
        # and shown; ``_request_id`` is the one logs use (the client's, else ours).
        self._exchange: Exchange | None = None
        self._request_id = ""
        self._spoofed: list[str] = []
        self._body = bytearray()
        self._decision: RoutingDecision | None = None
        self._received_at = 0.0
        self._queued: tuple[QueuedRoute, bytes, bool] | None = None

    @property
    def request_id(self) -> str:
        return self._request_id

    def handle(self, message: pb.ProcessingRequest) -> Responses:
        kind = message.WhichOneof("request")
        if message.HasField("protocol_config"):
            # On the stream's first message, which is response_headers when a filter before
            # ext_proc answered locally (e.g. the buffer filter's 413).
            self._request_mode = message.protocol_config.request_body_mode
            self._response_mode = message.protocol_config.response_body_mode
        try:
            if kind == "request_headers":
                return self._on_request_headers(message)
            if kind == "request_body":
                return self._on_request_body(message)
            if kind == "request_trailers":
                return self._on_request_trailers()
            if kind == "response_headers":
                return self._on_response_headers(message)
            if kind == "response_body":
                return self._on_response_body(message)
            if kind == "response_trailers":
                self._finish_response()
                return [messages.CONTINUE_RESPONSE_TRAILERS]
        except RequestError as exc:
            return self._reject(exc.code, exc.message, exc.model, exc.target_model)
        except Exception:
            # A bug (ours or a plugin's) still answers Envoy with a JSON 500, never a dead stream.
            log.exception("request failed unexpectedly", message_kind=kind)
            return self._reject(ErrorCode.INTERNAL, "internal error in the endpoint picker")
        return self._reject(ErrorCode.INTERNAL, f"unexpected ext_proc message {kind!r}")

    def _reject(
        self, code: ErrorCode, message: str, model: str = "", target_model: str = ""
    ) -> Responses:
        message = clip(message, _MAX_ERROR_MESSAGE)  # values in it are clipped; this bounds all
        log.info("request rejected", status=code.http_status, reason=message)
        self.finished = True
        if self._metrics is not None:
            self._metrics.request_failed(model, target_model, code)
        if self._on_reject is not None:
            self._on_reject(self._request_id, model, target_model, code, message)
        return [messages.immediate_error(code, message)]

    # -- request path ---------------------------------------------------------------------------

    def _on_request_headers(self, message: pb.ProcessingRequest) -> Responses:
        headers = message.request_headers
        header_bytes, has_content_length = 0, False
        path = client_id = ""
        wanted = self._director.request_headers
        collected: dict[str, str] = {}
        for header in headers.headers.headers:
            key = header.key.lower()
            header_bytes += len(key) + len(header.raw_value or header.value)
            if key == wire.CONTENT_LENGTH:
                has_content_length = True
            if key == ":path":
                path = messages.header_value(header)
            elif key == wire.REQUEST_ID_HEADER:
                client_id = _safe_request_id(messages.header_value(header))
            elif (
                key.startswith(wire.DESTINATION_HEADER_PREFIX) and key != wire.DESTINATION_ENDPOINT
            ):
                # a client may never choose the upstream (the destination itself is overwritten)
                self._spoofed.append(key)
            elif key in wanted:  # what the scheduler reads: session ids and tokens
                collected[key] = messages.header_value(header)[:_MAX_SCHEDULER_HEADER]
        self._received_at = self._clock()
        exchange = self._exchange = self._director.on_headers(
            path, client_id, messages.subset_hint(message), collected, headers.end_of_stream
        )
        self._request_id = client_id or exchange.id
        if client_id:
            structlog.contextvars.bind_contextvars(request_id=client_id, epp_request_id=exchange.id)
        else:
            structlog.contextvars.bind_contextvars(request_id=exchange.id)
        # The destination header, and the body's length when the client sent none, must still
        # fit Envoy's limits: past them Envoy drops the mutation with an empty 500.
        added = 1 + (0 if has_content_length or headers.end_of_stream else 1)
        count = len(headers.headers.headers) - len(self._spoofed) + added
        if count > self._max_headers or header_bytes + _ADDED_HEADER_BYTES > self._max_header_bytes:
            raise HeadersTooLargeError(
                f"too many or too large request headers ({len(headers.headers.headers)} headers, "
                f"{header_bytes} bytes): the gateway allows {self._max_headers} headers and "
                f"{self._max_header_bytes} bytes, its own included"
            )
        # Only the inference APIs go anywhere: a 404 now, before a byte of body is buffered.
        if exchange.error is not None:
            raise exchange.error
        local = exchange.local
        if local is not None:  # the gateway's health, or the model list: never a pod's
            self.finished = True
            if local.models is not None:
                body = messages.models_body(local.models, owner="endpoint-picker")
                return [messages.immediate_json(200, body, "epp_models")]
            if local.ready:
                return [messages.immediate_empty(200, "epp_health")]
            # a probe, not a rejected request: no error metric, no decision on the status page
            unready = "no ready endpoint in the pool"
            return [messages.immediate_error(ErrorCode.SERVICE_UNAVAILABLE, unready)]
        if headers.end_of_stream:
            decision = self._director.on_body(exchange, b"")
            assert isinstance(decision, RoutingDecision)  # headers only: never queued
            self._routed(decision)
            return [self._headers_response(decision, content_length=None)]
        if self._request_mode == FULL_DUPLEX:
            return []
        if self._request_mode == BUFFERED:
            return [messages.CONTINUE_REQUEST_HEADERS]
        mode = _MODE_NAMES.get(self._request_mode, str(self._request_mode))
        raise InternalError(
            f"request body mode {mode} is not supported: configure FULL_DUPLEX_STREAMED or BUFFERED"
        )

    def _on_request_body(self, message: pb.ProcessingRequest) -> Responses:
        body = message.request_body
        if self._decision is not None:  # chunks after routing (e.g. before trailers): pass on
            return [messages.streamed_request_body(body.body, body.end_of_stream)]
        size = len(body.body)
        if len(self._body) + size > self._max_body_bytes:
            self._drop_body()
            raise PayloadTooLargeError(
                f"request body exceeds the EPP's limit of {self._max_body_bytes} bytes"
            )
        # 429, not 413: this body is acceptable, the process is full of other bodies right now
        if not self._budget.try_reserve(size):
            self._drop_body()
            if self._metrics is not None:
                self._metrics.buffer_budget_rejections.inc()
            raise TooManyRequestsError(
                "the endpoint picker is holding too many request bodies; retry later"
            )
        self._body += body.body
        if body.end_of_stream or self._request_mode == BUFFERED:
            # BUFFERED sends the whole body in one message; without end_of_stream when
            # trailers follow, and Envoy waits for this answer before sending them.
            return self._route_body(end_of_stream=body.end_of_stream)
        return []

    def _on_request_trailers(self) -> Responses:
        if self._decision is None and self._request_mode == FULL_DUPLEX:
            # HTTP/2 trailers end the body: route now, then answer the trailers.
            return [*self._route_body(end_of_stream=False), messages.CONTINUE_REQUEST_TRAILERS]
        return [messages.CONTINUE_REQUEST_TRAILERS]

    def _drop_body(self) -> None:
        """Forget the buffered body and give its bytes back to the shared budget."""
        self._budget.release(len(self._body))
        self._body = bytearray()

    def _route_body(self, end_of_stream: bool) -> Responses:
        raw = bytes(self._body)
        self._drop_body()
        assert self._exchange is not None  # the headers came first
        outcome = self._director.on_body(self._exchange, raw)
        if isinstance(outcome, QueuedRoute):
            # Flow control holds it: the servicer awaits ``resume()`` before the next message.
            self._queued = (outcome, raw, end_of_stream)
            return []
        return self._routed_body(outcome, raw, end_of_stream)

    @property
    def queued(self) -> bool:
        """Whether the request waits in flow control (the servicer then awaits ``resume``)."""
        return self._queued is not None

    async def resume(self) -> Responses:
        """Wait for flow control to admit (or refuse) the request, then answer as ``handle``
        would have. Cancelling this (the client went away) takes it out of the queue."""
        assert self._queued is not None
        queued, raw, end_of_stream = self._queued
        self._queued = None
        try:
            decision = await queued.future
        except asyncio.CancelledError:
            future = queued.future
            if future.done() and not future.cancelled() and future.exception() is None:
                # admitted and routed just as the client left: ``close`` must finish it
                self._routed(future.result())
            raise
        except RequestError as exc:
            request = queued.request
            return self._reject(exc.code, exc.message, request.model, request.target_model)
        except Exception:
            log.exception("request failed unexpectedly while queued")
            return self._reject(ErrorCode.INTERNAL, "internal error in the endpoint picker")
        return self._routed_body(decision, raw, end_of_stream)

    def _routed_body(self, decision: RoutingDecision, raw: bytes, end_of_stream: bool) -> Responses:
        self._routed(decision)
        if self._request_mode == BUFFERED:
            new_body = decision.body if decision.body is not raw else None
            return [
                messages.routed_buffered_body(
                    decision.destination, len(decision.body), self._spoofed, new_body
                )
            ]
        out = [self._headers_response(decision, content_length=len(decision.body))]
        out.extend(
            messages.streamed_request_body(chunk, eos)
            for chunk, eos in messages.streamed_chunks(decision.body, end_of_stream)
        )
        return out

    def _headers_response(
        self, decision: RoutingDecision, content_length: int | None
    ) -> pb.ProcessingResponse:
        return messages.routed_request_headers(decision.destination, content_length, self._spoofed)

    def _routed(self, decision: RoutingDecision) -> None:
        self._decision = decision
        assert self._exchange is not None
        self._exchange.decision = decision
        request = decision.request
        log.debug(
            "request routed",
            model=request.model,
            target_model=request.target_model,
            endpoints=decision.destination,
            body_bytes=len(decision.body),
        )
        if self._metrics is not None:
            self._metrics.request_started(
                request.model, request.target_model, len(request.raw_body)
            )

    # -- response path --------------------------------------------------------------------------

    def _on_response_headers(self, message: pb.ProcessingRequest) -> Responses:
        head = messages.response_head(message)
        exchange = self._exchange
        token = None
        if exchange is not None:
            token = self._director.on_response_headers(exchange, head)
        if head.status >= 400 and self._decision is not None and self._metrics is not None:
            request = self._decision.request
            self._metrics.request_failed(request.model, request.target_model, MODEL_SERVER_ERROR)
        if message.response_headers.end_of_stream:
            self._finish_response()
        if token is not None:
            return [messages.response_headers_with(SESSION_TOKEN_HEADER, token)]
        return [messages.CONTINUE_RESPONSE_HEADERS]

    def _on_response_body(self, message: pb.ProcessingRequest) -> Responses:
        body = message.response_body
        if self._exchange is not None:
            self._director.on_response_body(self._exchange, body.body)
        if body.end_of_stream:
            self._finish_response()
        if self._response_mode != FULL_DUPLEX:
            return [messages.CONTINUE_RESPONSE_BODY]
        return [
            messages.streamed_response_body(chunk, eos)
            for chunk, eos in messages.streamed_chunks(body.body, body.end_of_stream)
        ]

    def _finish_response(self) -> None:
        exchange = self._exchange
        if exchange is None or self._decision is None:
            return
        seconds = self._clock() - self._received_at
        if not self._director.on_finish(exchange, True, seconds):
            return
        request = self._decision.request
        reader = exchange.usage
        usage = reader.usage if reader is not None else None
        log.debug(
            "response complete",
            served=exchange.served or self._decision.endpoints[0],
            response_bytes=reader.body_bytes if reader else 0,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
        )
        if self._metrics is not None:
            self._metrics.request_finished(
                request.model,
                request.target_model,
                seconds=seconds,
                response_bytes=reader.body_bytes if reader else 0,
                input_tokens=usage.prompt_tokens if usage else None,
                output_tokens=usage.completion_tokens if usage else None,
                invalid_usage=reader is not None and reader.invalid,
            )

    def close(self) -> None:
        """The stream ended (normally or cancelled): release what a routed request holds."""
        if self._queued is not None:  # never resumed: leave the queue
            self._queued[0].future.cancel()
            self._queued = None
        exchange = self._exchange
        if exchange is not None and self._decision is not None:
            seconds = self._clock() - self._received_at
            # no verdict on the endpoint, but a probe ends; the finished event if not sent
            if self._director.on_finish(exchange, False, seconds) and self._metrics is not None:
                self._metrics.request_abandoned(self._decision.request.model)
        self._drop_body()
        structlog.contextvars.unbind_contextvars("request_id", "epp_request_id")
