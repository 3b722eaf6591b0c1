"""Session affinity: the requests of one conversation keep going to the same endpoint.

Two ways in, as users of the reference EPP and of the peer routers expect:

- the reference's contract: the EPP answers every response with ``x-session-token``, an opaque
  token naming the endpoint that served it; a request that sends the token back prefers that
  endpoint;
- a session id header the client sets (``sessionHeader``, default ``x-session-id``): the EPP
  remembers where the session last went (an LRU of ``maxSessions`` ids) and prefers it.

Either way the preference is a score, not a rule: an endpoint that is gone, stale or past the
load bound is no candidate (the filters removed it), and the session moves on, to be
remembered where it lands next. A session id seen for the first time is placed
(``deterministicPlacement``, on by default) by rendezvous hashing of the id over the
candidates, so every replica starts the same session on the same endpoint (``placement.py``).
"""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from endpoint_picker.errors import kept
from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.lifecycle import Finished, Routed, remember
from endpoint_picker.scheduling.placement import (
    RING_CHOICES,
    Placement,
    RingWalk,
    stable_hash,
)
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.types import EndpointState, parse_hostport

SESSION_TOKEN_HEADER = "x-session-token"


def session_token(hostport: str) -> str:
    """The opaque token for an endpoint (URL-safe base64 of ``host:port``)."""
    return base64.urlsafe_b64encode(hostport.encode()).decode().rstrip("=")


def token_endpoint(token: str) -> str | None:
    """The endpoint a token names, or None for a token that is not ours."""
    if not token or len(token) > 128:
        return None
    try:
        padded = token + "=" * (-len(token) % 4)
        text = base64.b64decode(padded.encode("ascii"), altchars=b"-_", validate=True).decode()
        _, port = parse_hostport(text)
    except (binascii.Error, UnicodeError, ValueError):
        return None
    return text if port is not None else None


class SessionAffinityScorer:
    """1.0 for the endpoint the request's session token or session id points at, else 0."""

    __slots__ = (
        "_header",
        "_max_sessions",
        "_placed",
        "_placement",
        "_sessions",
        "request_headers",
    )

    issues_session_tokens = True

    def __init__(self, header: str, max_sessions: int, placement: bool = True) -> None:
        self._placement = Placement() if placement else None
        self._header = header.lower()
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()
        # requests of a sampled pool: their new session's place on the ring (``preferred``)
        self._placed: OrderedDict[str, list[str]] = OrderedDict()
        self.request_headers = frozenset({SESSION_TOKEN_HEADER, self._header})

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> SessionAffinityScorer:
        header = params.string("sessionHeader", "x-session-id")
        return cls(
            header,
            params.integer("maxSessions", 100_000, minimum=1),
            params.boolean("deterministicPlacement", True),
        )

    def _wanted(self, request: LLMRequest) -> str | None:
        headers = request.headers
        by_token = token_endpoint(headers.get(SESSION_TOKEN_HEADER, ""))
        if by_token is not None:
            return by_token
        session = headers.get(self._header)
        return self._sessions.get(kept(session)) if session else None

    def preferred(self, request: LLMRequest, ring: RingWalk) -> Iterable[str]:
        """For a sampled pool: the session's endpoint, or a new session's place on ``ring``."""
        wanted = self._wanted(request)
        if wanted is not None:
            return (wanted,)
        session = request.headers.get(self._header)
        if not session or self._placement is None:
            return ()
        order = ring.walk(stable_hash(session), RING_CHOICES)
        remember(self._placed, request.request_id, order)
        return order

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        placed = self._placed.pop(request.request_id, None) if self._placed else None
        wanted = self._wanted(request)
        if wanted is not None:
            return [1.0 if e.hostport == wanted else 0.0 for e in endpoints]
        scores = [0.0] * len(endpoints)
        session = request.headers.get(self._header)
        if session and self._placement is not None and endpoints:
            hostports = [e.hostport for e in endpoints]
            place = self._placement.place(stable_hash(session), placed, hostports)
            if place is not None:
                scores[place] = 1.0
        return scores

    def on_routed(self, event: Routed) -> None:
        session = event.request.headers.get(self._header)
        if not session:
            return
        sessions = self._sessions
        session = kept(session)  # a client's header: a long one is kept as its cut and digest
        sessions[session] = event.endpoint
        sessions.move_to_end(session)
        if len(sessions) > self._max_sessions:
            sessions.popitem(last=False)

    def on_finished(self, event: Finished) -> None:
        self._placed.pop(event.request_id, None)
