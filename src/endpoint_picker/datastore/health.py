"""Outlier detection: eject endpoints on what their responses say, as Envoy does.

Scrapes say how busy a model server is, not whether it answers: a server that accepts
connections and drops them, or whose ``/metrics`` answers while its completions fail, looks
idle and would draw traffic for ever. The director reports each routed request's outcome here
(Envoy's ``consecutive_5xx``: a 5xx response, Envoy's own 503 for a reset or a refused
connection included, or an attempt Envoy retried past); the director leaves the endpoints
``excluded`` returns out of its candidates, as it does NotReady ones.

An endpoint's life, keyed by its ``host:port`` (never by anything a client sends)::

    ok --N consecutive failures--> ejected --ejection time over--> probing
    probing --the probe request succeeds--> ok
    probing --the probe request fails-----> ejected (for longer)

Choices, each Envoy's unless said:
- Ejection time: ``base_ejection_time`` x the times ejected in a row, at most
  ``max_ejection_time``; every ``base_ejection_time`` an endpoint stays healthy forgives one
  ejection (Envoy forgives one per ``interval``, which the EPP has no timer for).
- At most ``max_ejection_percent`` of the ready endpoints are out at once, at least one; and
  (ours) never the last ready one: ejection must never turn traffic away wholesale. When the
  cap holds an endpoint in, its failures keep counting and the next one tries again.
- Recovery (ours; Envoy simply returns the host): once its ejection time is over the endpoint
  is a candidate again, and the first request routed to it is its *probe*; until that
  request's response headers come back it is left out again, so one request, not a burst,
  tells whether it recovered. Only the serving path proves a recovery (a wedged server may
  still answer ``/metrics`` or ``/health``), and a real request is the only probe of it that
  needs no model name or prompt of our own. A probe that never answers (its stream closed
  first, or silent for a base ejection time) lets another request probe.
- While ejected, outcomes of requests routed before the ejection are counted in the metrics
  but change nothing.

Per process: with ``--workers`` each worker judges the responses it routed and ejects on its
own (the parent routes nothing and sees no response; sharing would add a message per failure
to a channel that carries the pool). Each worker needs its own ``consecutive_failures``
failures, so with N workers a failing pod costs up to N times as many before all eject it.

Records exist only for endpoints of the pool (``failed`` is told which are ready) and are
dropped when an endpoint leaves it, so the state is bounded by the pool's size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import structlog

from endpoint_picker.settings import OutlierSettings
from endpoint_picker.types import EndpointState

log = structlog.get_logger(__name__)

_NOTHING: frozenset[str] = frozenset()


class Excluder(Protocol):
    def excluded(self) -> frozenset[str]: ...


def without_excluded(
    states: tuple[EndpointState, ...], outliers: Excluder | None
) -> tuple[EndpointState, ...]:
    """``states`` without the endpoints outlier detection leaves out now; all of them when it
    would leave out every one (ejection never turns a request away by itself)."""
    out = outliers.excluded() if outliers is not None else None
    if not out:
        return states
    return tuple(s for s in states if s.hostport not in out) or states


class OutlierState(StrEnum):
    OK = "ok"
    EJECTED = "ejected"
    PROBING = "probing"  # back after its ejection: the next request routed to it is a probe


class FailureKind(StrEnum):
    """What a failure was (the metrics' ``kind`` label)."""

    STATUS_5XX = "5xx"  # a 5xx response: the server's, or Envoy's for a reset
    CONNECT = "connect"  # Envoy could not connect (its local reply says so)
    RETRIED = "retried"  # Envoy's retry moved past it to a fallback endpoint


class OutlierObserver(Protocol):
    """Where failures and ejections are counted (``EppMetrics``)."""

    def endpoint_failed(self, hostport: str, kind: str) -> None: ...

    def endpoint_ejected(self, hostport: str) -> None: ...

    def endpoints_forgotten(self, hostports: Iterable[str]) -> None: ...


@dataclass(frozen=True, slots=True)
class OutlierStatus:
    """One endpoint's passive health, for the status page."""

    state: OutlierState
    consecutive_failures: int
    ejections: int  # times ejected in a row (the ejection time's multiplier)
    seconds_left: float | None  # of the current ejection
    last_failure: str | None
    probe_in_flight: bool


@dataclass(slots=True)
class _Record:
    failures: int = 0  # consecutive
    ejections: int = 0
    until: float = 0.0  # monotonic end of the current ejection
    state: OutlierState = OutlierState.OK
    probe_since: float | None = None  # a probe request is in flight since then
    healthy_since: float = 0.0  # when it last came back (forgiveness counts from there)
    last_failure: str | None = None


class OutlierDetector:
    """Per-endpoint consecutive failures and ejections; event-loop only, no task of its own."""

    def __init__(
        self,
        settings: OutlierSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        observer: OutlierObserver | None = None,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._observer = observer
        self._records: dict[str, _Record] = {}
        self._out: dict[str, _Record] = {}  # ejected or probing
        # ``excluded``'s answer and until when it holds (the next ejection or probe to expire)
        self._cache: frozenset[str] | None = _NOTHING
        self._cache_until = float("inf")

    # -- what the director asks on every pick ---------------------------------------------------

    def excluded(self) -> frozenset[str]:
        """The endpoints to leave out of the candidates now: ejected, or probing with their
        probe in flight."""
        if not self._out:
            return _NOTHING
        now = self._clock()
        if self._cache is not None and now < self._cache_until:
            return self._cache
        out: set[str] = set()
        until = float("inf")
        probe_timeout = self._settings.base_ejection_time
        for hostport, record in self._out.items():
            if record.state is OutlierState.EJECTED:
                if now < record.until:
                    out.add(hostport)
                    until = min(until, record.until)
                    continue
                record.state, record.failures = OutlierState.PROBING, 0
                log.info("ejection over; the next request probes the endpoint", endpoint=hostport)
            if record.probe_since is not None:
                if now < record.probe_since + probe_timeout:
                    out.add(hostport)
                    until = min(until, record.probe_since + probe_timeout)
                else:
                    record.probe_since = None  # a probe that never answered: let another try
        self._cache, self._cache_until = frozenset(out), until
        return self._cache

    def routed(self, hostport: str) -> bool:
        """A request was routed to ``hostport`` first; True when it is that endpoint's probe
        (its outcome, or ``unanswered``, must then follow)."""
        record = self._out.get(hostport)
        if record is None:
            return False
        self.excluded()  # an ejection that is over becomes probing first
        if record.state is not OutlierState.PROBING or record.probe_since is not None:
            return False
        record.probe_since = self._clock()
        self._cache = None
        return True

    # -- what the responses say -----------------------------------------------------------------

    def succeeded(self, hostport: str) -> None:
        record = self._records.get(hostport)
        if record is None:
            return
        self.excluded()  # an ejection that is over becomes probing first
        if self._still_ejected(record):
            return
        if record.state is OutlierState.PROBING:
            log.info("probe succeeded; endpoint back in the pool", endpoint=hostport)
            record.state, record.probe_since = OutlierState.OK, None
            record.healthy_since = self._clock()
            self._out.pop(hostport, None)
            self._cache = None
        record.failures = 0
        if record.state is OutlierState.OK and self._forgive(record) == 0:
            del self._records[hostport]

    def failed(self, hostport: str, kind: FailureKind, ready: Collection[str]) -> bool:
        """A routed request failed on ``hostport``; ``ready``: the pool's ready endpoints now.
        True when this ejected it."""
        record = self._records.get(hostport)
        if record is None:
            if hostport not in ready:
                return False  # left the pool, or never in it: nothing to remember
            record = self._records[hostport] = _Record()
        if self._observer is not None:
            self._observer.endpoint_failed(hostport, kind)
        record.last_failure = kind
        self.excluded()  # an ejection that is over becomes probing first
        if self._still_ejected(record):
            return False
        record.failures += 1
        if record.state is OutlierState.PROBING:
            log.warning("probe failed; endpoint ejected again", endpoint=hostport, kind=kind)
            self._eject(hostport, record)
            return True
        if record.failures < self._settings.consecutive_failures:
            return False
        if not self._may_eject(ready):
            if record.failures == self._settings.consecutive_failures:
                log.warning(
                    "endpoint failing but not ejected: the ejection cap is reached",
                    endpoint=hostport,
                    ejected=len(self._out),
                    ready=len(ready),
                )
            return False
        self._eject(hostport, record)
        return True

    def unanswered(self, hostport: str) -> None:
        """A probe's stream ended before its response: let another request probe."""
        record = self._out.get(hostport)
        if record is not None and record.probe_since is not None:
            record.probe_since = None
            self._cache = None

    # -- the pool -------------------------------------------------------------------------------

    def endpoints_changed(self, hostports: Iterable[str]) -> None:
        """Forget the endpoints that left the pool."""
        live = set(hostports)
        gone = [h for h in self._records if h not in live]
        for hostport in gone:
            del self._records[hostport]
            self._out.pop(hostport, None)
        if gone:
            self._cache = None
            if self._observer is not None:
                self._observer.endpoints_forgotten(gone)

    def status(self, hostport: str) -> OutlierStatus | None:
        """``hostport``'s passive health, None when it has no failure on record."""
        self.excluded()  # move ejections that are over to probing
        record = self._records.get(hostport)
        if record is None:
            return None
        left = None
        if record.state is OutlierState.EJECTED:
            left = max(0.0, record.until - self._clock())
        return OutlierStatus(
            state=record.state,
            consecutive_failures=record.failures,
            ejections=record.ejections,
            seconds_left=left,
            last_failure=record.last_failure,
            probe_in_flight=record.probe_since is not None,
        )

    def ejected(self) -> list[str]:
        """The endpoints ejected now (the ``inference_extension_endpoint_ejected`` gauge)."""
        self.excluded()
        return [h for h, r in self._out.items() if r.state is OutlierState.EJECTED]

    # -- internals ------------------------------------------------------------------------------

    def _still_ejected(self, record: _Record) -> bool:
        return record.state is OutlierState.EJECTED and self._clock() < record.until

    def _may_eject(self, ready: Collection[str]) -> bool:
        out = sum(1 for h in self._out if h in ready)
        cap = max(1, len(ready) * self._settings.max_ejection_percent // 100)
        return out < cap and out + 1 < len(ready)

    def _forgive(self, record: _Record) -> int:
        """Forgive one ejection per base ejection time healthy since the last; what is left."""
        base = self._settings.base_ejection_time
        if record.ejections and base > 0:
            now = self._clock()
            forgiven = int((now - record.healthy_since) // base)
            if forgiven:
                record.ejections = max(0, record.ejections - forgiven)
                record.healthy_since += forgiven * base
        return record.ejections

    def _eject(self, hostport: str, record: _Record) -> None:
        settings, now = self._settings, self._clock()
        base = settings.base_ejection_time
        if record.state is OutlierState.OK:
            self._forgive(record)
        record.ejections += 1
        seconds = min(base * record.ejections, max(base, settings.max_ejection_time))
        record.state, record.until, record.probe_since = OutlierState.EJECTED, now + seconds, None
        self._out[hostport] = record
        self._cache = None
        log.warning(
            "endpoint ejected",
            endpoint=hostport,
            consecutive_failures=record.failures,
            last_failure=record.last_failure,
            seconds=seconds,
            ejections=record.ejections,
        )
        if self._observer is not None:
            self._observer.endpoint_ejected(hostport)
