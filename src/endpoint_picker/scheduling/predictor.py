"""A latency model per endpoint, learned online in process: what a request will feel there.

For each endpoint the predictor keeps two small linear models, fitted by recursive least squares
with exponential forgetting (each sample's weight decays by ``forgetting`` per newer sample, so
the fit follows a fleet that changes):

- **TTFT** (seconds from routing to the first response bytes of a streamed request) against what
  the request will wait for and compute there (``TTFT_FEATURES``): its own uncached prompt tokens
  (the prompt less the leading blocks the endpoint likely caches), the uncached prompt tokens of
  the requests routed there that have not started, the requests waiting, the running batch, the
  KV cache's fill, and the request's LoRA adapter: whether it must be loaded there, and whether
  it must also wait for a slot (every slot held by other adapters);
- **TPOT** (seconds per output token after the first) against the batch the request joins
  (running + waiting + itself), the prefill work ahead of it, and the KV cache's fill.

Before any sample an endpoint's model is the *physical prior*: rough costs of an 8B model on one
modern GPU (a prefill token, a decode step), there only so that the first picks are sane; the
fit replaces them within a few dozen samples. A **pooled** model learns from every endpoint's
samples; a new endpoint starts from it rather than from the prior. Each model's spread is the
exponentially weighted mean and variance of its log residuals (``log(observed / predicted)``), so
a quantile is the mean prediction times ``exp(mu + z x sd)``: multiplicative, never negative.
Its error, the weighted mean of ``|observed - predicted| / observed`` of TTFT, is exported per
endpoint (``errors``).

State per endpoint is O(d^2) floats (d <= 8); endpoints that leave the pool are dropped; the
requests remembered between routing and finish are bounded (``REQUESTS_REMEMBERED``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import mul
from typing import Any, Protocol, runtime_checkable

from endpoint_picker.scheduling.lifecycle import REQUESTS_REMEMBERED, Finished, Routed
from endpoint_picker.scheduling.rls import MIN_PREDICTION, SMOOTHING, OnlineLinear

# Features (the intercept first). Units keep every feature near [0, 10] so one prior covariance
# fits them all: tokens in thousands, requests in tens.
TTFT_FEATURES = (
    "1", "uncached_ktok", "ahead_ktok", "waiting_x10", "running_x10", "kv", "adapter_load",
    "adapter_wait",
)  # fmt: skip
TPOT_FEATURES = ("1", "batch_x10", "ahead_ktok", "kv")
# The physical prior, seconds per unit of each feature: a prefill of about 20,000 tokens/s,
# waiting requests and batch members that each lengthen the steps a little, a decode step of
# about 15 ms, an adapter loaded in 25 ms, a slot freed in about 300 ms. Deliberately rough:
# the fit replaces it.
TTFT_PRIOR = (0.03, 0.05, 0.05, 0.02, 0.01, 0.0, 0.025, 0.3)
TPOT_PRIOR = (0.015, 0.002, 0.002, 0.0)
Z_P90 = 1.2816  # the standard normal's 90th percentile
# the pooled model (a new endpoint's start) learns from every POOLED_EVERY-th sample of each
# endpoint: a prior needs no more, and each update costs as much as the endpoint's own
POOLED_EVERY = 4
FAST_QUANTILE = 0.1  # the "unloaded" floor: this quantile of an endpoint's observed TTFT
FAST_STEP = 0.05


@runtime_checkable
class PredictorObserver(Protocol):
    """Where the predictor's error is exported (the EPP's metrics)."""

    def track_latency_predictor(self, errors: Callable[[], Mapping[str, float]]) -> None: ...


@dataclass(frozen=True, slots=True)
class Prediction:
    """What one request is predicted to feel on one endpoint (seconds)."""

    ttft: float
    ttft_p90: float
    tpot: float
    tpot_p90: float
    # the share of ``ttft`` that is the request's own uncached prefill (the learned cost per
    # uncached token times its uncached tokens): how long it holds up the endpoint's others
    prefill: float = 0.0


class _EndpointModel:
    __slots__ = ("error", "errors_seen", "fast", "tpot", "ttft")

    def __init__(self, ttft: OnlineLinear, tpot: OnlineLinear) -> None:
        self.ttft = ttft
        self.tpot = tpot
        self.error = 0.0  # EW mean absolute relative error of TTFT
        self.errors_seen = 0
        self.fast = 0.0  # a running estimate of the 10th percentile of observed TTFT

    def observe_fast(self, ttft: float) -> None:
        """Move the 10th-percentile estimate (a stochastic quantile step, relative in size)."""
        if self.fast <= 0.0:
            self.fast = ttft
        else:
            self.fast *= 1.0 + FAST_STEP * (FAST_QUANTILE - (1.0 if ttft < self.fast else 0.0))


class _Flight:
    """A routed request between routing and finish: the features it was predicted with."""

    __slots__ = (
        "endpoint",
        "learn_ttft",
        "routed_at",
        "started_at",
        "tpot_x",
        "ttft_x",
        "uncached",
    )

    def __init__(
        self,
        endpoint: str,
        routed_at: float,
        ttft_x: tuple[float, ...] | None,
        tpot_x: tuple[float, ...] | None,
        uncached: float,
        learn_ttft: bool,
    ) -> None:
        self.endpoint = endpoint
        self.routed_at = routed_at
        self.started_at: float | None = None
        self.ttft_x = ttft_x
        self.tpot_x = tpot_x
        self.uncached = uncached  # thousands of tokens, counted in the endpoint's work ahead
        self.learn_ttft = learn_ttft


class LatencyPredictor:
    """TTFT and TPOT predictions per endpoint, learned from the lifecycle events.

    The plugin that scores a request hands the predictor, before the request is routed, the
    features it computed for each candidate (``expect``); on ``Routed`` the routed endpoint's
    features are kept with the request, and the request's uncached prompt tokens join that
    endpoint's work ahead until its first bytes (``on_started``), which also give the TTFT
    sample; ``Finished`` gives the TPOT sample. Only streamed requests teach TTFT (a
    non-streamed response's first bytes are its last).
    """

    __slots__ = (
        "_ahead", "_clock", "_expected", "_flights", "_forgetting", "_live", "_models", "_pooled",
        "_queued", "_unstarted",
    )  # fmt: skip

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, forgetting: float = 0.995
    ) -> None:
        self._clock = clock
        self._forgetting = forgetting
        self._models: dict[str, _EndpointModel] = {}
        self._pooled = self._new_model()
        self._expected: OrderedDict[str, dict[str, tuple[tuple[float, ...], tuple[float, ...]]]]
        self._expected = OrderedDict()
        self._flights: OrderedDict[str, _Flight] = OrderedDict()
        self._ahead: dict[str, float] = {}  # uncached ktok routed here and not started
        self._unstarted: dict[str, int] = {}
        # per endpoint, the streamed requests routed there and not started, oldest first
        self._queued: dict[str, OrderedDict[str, float]] = {}
        self._live: frozenset[str] | None = None  # the pool's endpoints, once told

    def _new_model(self) -> _EndpointModel:
        return _EndpointModel(
            OnlineLinear(TTFT_PRIOR, self._forgetting), OnlineLinear(TPOT_PRIOR, self._forgetting)
        )

    def model(self, hostport: str) -> _EndpointModel:
        """The endpoint's model; a new endpoint starts from the pooled one once it has
        samples, else from the prior."""
        m = self._models.get(hostport)
        if m is None:
            m = self._models[hostport] = self._new_model()
            if self._pooled.ttft.samples:
                m.ttft.copy_from(self._pooled.ttft)
            if self._pooled.tpot.samples:
                m.tpot.copy_from(self._pooled.tpot)
        return m

    def now(self) -> float:
        """The predictor's clock (seconds)."""
        return self._clock()

    def ahead(self, hostport: str) -> tuple[float, int]:
        """(uncached ktok, requests) routed to ``hostport`` by this EPP and not started."""
        return self._ahead.get(hostport, 0.0), self._unstarted.get(hostport, 0)

    def head_wait(self, hostport: str) -> float:
        """Seconds the oldest streamed request routed to ``hostport`` and not started has
        waited (0: none). A request queued there now waits about as long: the head-of-line
        delay predictor of queueing theory. It sees a queue building at once, where the fitted
        model learns of it only when the queued requests start, a queue's wait too late."""
        queued = self._queued.get(hostport)
        if not queued:
            return 0.0
        return max(0.0, self._clock() - next(iter(queued.values())))

    def predict(
        self, hostport: str, ttft_x: Sequence[float], tpot_x: Sequence[float]
    ) -> Prediction:
        m = self.model(hostport)
        ttft, tpot = m.ttft.mean(ttft_x), m.tpot.mean(tpot_x)
        prefill = max(0.0, m.ttft.theta[1]) * ttft_x[1]
        return Prediction(
            ttft,
            ttft * m.ttft.quantile_factor(Z_P90),
            tpot,
            tpot * m.tpot.quantile_factor(Z_P90),
            prefill if prefill < ttft else ttft,
        )

    def means(
        self, hostport: str, ttft_x: Sequence[float], tpot_x: Sequence[float]
    ) -> tuple[float, float, float]:
        """``predict``'s (TTFT, TPOT, prefill) means alone: the cheap path every pick takes."""
        m = self._models.get(hostport) or self.model(hostport)
        theta = m.ttft.theta
        ttft: float = sum(map(mul, theta, ttft_x))
        tpot: float = sum(map(mul, m.tpot.theta, tpot_x))
        ttft = ttft if ttft > MIN_PREDICTION else MIN_PREDICTION
        prefill = theta[1] * ttft_x[1] if theta[1] > 0.0 else 0.0
        return ttft, tpot if tpot > MIN_PREDICTION else MIN_PREDICTION, min(prefill, ttft)

    def expect(
        self, request_id: str, features: dict[str, tuple[tuple[float, ...], tuple[float, ...]]]
    ) -> None:
        """The (TTFT, TPOT) features of each candidate, for the request about to be routed."""
        self._expected[request_id] = features
        if len(self._expected) > REQUESTS_REMEMBERED:
            self._expected.popitem(last=False)

    def fast_ttft(self, hostport: str) -> float:
        """About the 10th percentile of the TTFT observed on ``hostport`` lately (0: none):
        a floor under the regression's extrapolation to an unloaded endpoint, which a fit of
        a busy endpoint can put too low (even below zero, clamped)."""
        m = self._models.get(hostport)
        return m.fast if m is not None else 0.0

    def routed_uncached(self, request_id: str) -> float | None:
        """The uncached prompt (ktok) a routed request was predicted with, if it was."""
        flight = self._flights.get(request_id)
        return flight.ttft_x[1] if flight is not None and flight.ttft_x is not None else None

    def errors(self) -> Mapping[str, float]:
        """Per endpoint with samples: the recent mean absolute relative error of TTFT."""
        return {h: m.error for h, m in self._models.items() if m.errors_seen}

    def describe(self, hostport: str) -> dict[str, Any] | None:
        """The status page's view of an endpoint's model (None before it has one)."""
        m = self._models.get(hostport)
        if m is None:
            return None
        return {
            "ttftSamples": m.ttft.samples,
            "tpotSamples": m.tpot.samples,
            "ttftRelativeError": round(m.error, 4) if m.errors_seen else None,
            "ttftCoefficients": dict(
                zip(TTFT_FEATURES, (round(t, 6) for t in m.ttft.theta), strict=True)
            ),
            "tpotCoefficients": dict(
                zip(TPOT_FEATURES, (round(t, 6) for t in m.tpot.theta), strict=True)
            ),
        }

    def samples(self, hostport: str) -> tuple[int, int]:
        m = self._models.get(hostport)
        return (m.ttft.samples, m.tpot.samples) if m is not None else (0, 0)

    # -- lifecycle -------------------------------------------------------------------------

    def on_routed(self, event: Routed) -> None:
        request = event.request
        rid = request.request_id
        old = self._flights.pop(rid, None)
        if old is not None and old.started_at is None:  # routed again: move its work
            self._leave_ahead(rid, old)
        features = self._expected.pop(rid, None)
        ttft_x, tpot_x = features.get(event.endpoint, (None, None)) if features else (None, None)
        uncached = ttft_x[1] if ttft_x is not None else 0.0
        now = self._clock()
        flight = _Flight(event.endpoint, now, ttft_x, tpot_x, uncached, request.stream)
        self._flights[rid] = flight
        if request.stream:  # a response that is not streamed starts only when it ends
            self._queued.setdefault(event.endpoint, OrderedDict())[rid] = now
        self._ahead[event.endpoint] = self._ahead.get(event.endpoint, 0.0) + uncached
        self._unstarted[event.endpoint] = self._unstarted.get(event.endpoint, 0) + 1
        if len(self._flights) > REQUESTS_REMEMBERED:  # a request whose finish never came
            dropped_id, dropped = self._flights.popitem(last=False)
            if dropped.started_at is None:
                self._leave_ahead(dropped_id, dropped)

    def on_started(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is None or flight.started_at is not None:
            return
        now = self._clock()
        flight.started_at = now
        self._leave_ahead(request_id, flight)
        if flight.learn_ttft and flight.ttft_x is not None and self._is_live(flight.endpoint):
            ttft = now - flight.routed_at
            m = self.model(flight.endpoint)
            predicted = m.ttft.update(flight.ttft_x, ttft)
            if m.ttft.samples % POOLED_EVERY == 0:
                self._pooled.ttft.update(flight.ttft_x, ttft)
            m.observe_fast(ttft)
            if ttft > 0:
                m.error += SMOOTHING * (abs(ttft - predicted) / ttft - m.error)
                m.errors_seen += 1

    def on_finished(self, event: Finished) -> None:
        flight = self._flights.pop(event.request_id, None)
        if flight is None:
            return
        if flight.started_at is None:
            self._leave_ahead(event.request_id, flight)
            return
        tokens = event.output_tokens
        if not event.ok or tokens is None or tokens < 2 or flight.tpot_x is None:
            return
        if not flight.learn_ttft or not self._is_live(flight.endpoint):  # not streamed: the
            return  # first bytes came at the end
        m = self.model(flight.endpoint)
        tpot = (self._clock() - flight.started_at) / (tokens - 1)
        m.tpot.update(flight.tpot_x, tpot)
        if m.tpot.samples % POOLED_EVERY == 0:
            self._pooled.tpot.update(flight.tpot_x, tpot)

    def _is_live(self, hostport: str) -> bool:
        return self._live is None or hostport in self._live

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        self._live = hostports
        for table in (self._models, self._ahead, self._unstarted, self._queued):
            for gone in [h for h in table if h not in hostports]:
                del table[gone]

    def _leave_ahead(self, request_id: str, flight: _Flight) -> None:
        endpoint = flight.endpoint
        queued = self._queued.get(endpoint)
        if queued is not None and queued.pop(request_id, None) is not None and not queued:
            del self._queued[endpoint]
        if endpoint in self._unstarted:
            left = self._unstarted[endpoint] - 1
            ahead = self._ahead.get(endpoint, 0.0) - flight.uncached
            if left > 0:
                self._unstarted[endpoint] = left
                self._ahead[endpoint] = max(0.0, ahead)
            else:
                del self._unstarted[endpoint]
                self._ahead.pop(endpoint, None)
        flight.uncached = 0.0
