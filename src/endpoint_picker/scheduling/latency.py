"""Observed latency per output token, per endpoint and target model, from the EPP's own traffic.

The seed's objective is "average latency per output token at P95 over multiple requests": for
each request, end-to-end seconds / output tokens (queueing and prefill included, unlike TPOT),
and the P95 of that over a recent time window. ``LatencyTracker`` learns it from the lifecycle
events: ``Routed`` says where a request went (and the endpoint's load then), ``Finished`` how
long it took and how many tokens it generated. A request that failed, or generated nothing, is
no sample.

Two views of the same samples, both over a sliding window (``window`` seconds, at most
``max_samples`` per key, O(1) amortised per sample):

- **observed**: per (endpoint, target model), the P95 of the samples, read from a sorted copy
  kept beside the ring (``bisect``: a binary search and a C memmove per sample, about a
  microsecond at 512 samples, so a read is one index);
- **fitted**: per endpoint (and for the whole pool), a least-squares line of latency per token
  against the load the request met when it was routed (this EPP's requests in flight on the
  endpoint, itself included), from running sums. Decode steps grow with the batch, so the line
  says what a request routed *now*, at today's load, should expect; the residual spread turns
  its mean into a P95 (``mean + 1.645 x sd``, as if residuals were normal).

``predict`` blends them: the observed P95, moved along the fitted slope from the load its
samples met to today's, weighted by how many samples there are (``min_samples`` or more: the
observation alone), and the fitted P95 for the rest. An endpoint with no samples of its own uses
the pool's line; with no samples anywhere there is no prediction (``None``).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Sequence

from endpoint_picker.errors import kept
from endpoint_picker.scheduling.lifecycle import Finished, InFlight, Routed

Z_95 = 1.645  # the standard normal's 95th percentile
_POOL = ""  # the endpoint key of the windows over every endpoint's samples
_POOL_LIMIT = 8  # those hold this many times max_samples: they see the whole pool's traffic
# Target models with windows of their own: a pool that passes unknown models lets clients name
# them, and a stream of made-up names must not grow the tracker; past this many, a new name's
# samples feed the fits only (its prediction is the fitted line's, as for a model never seen).
MAX_MODELS = 1000


def p95(ordered: list[float]) -> float:
    """The 95th percentile of sorted ``ordered`` (not empty), between the closest ranks."""
    rank = 0.95 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class _Window:
    """Samples ``(time, load, seconds per token)`` in arrival order, with running sums for the
    fit and, when ``ranked``, the latencies sorted for the P95. Old samples leave from the left
    (by age or count)."""

    __slots__ = ("_line", "_observed", "n", "ranked", "samples", "sx", "sxx", "sxy", "sy", "syy")

    def __init__(self, ranked: bool = False) -> None:
        self.samples: deque[tuple[float, float, float]] = deque()
        self.ranked: list[float] | None = [] if ranked else None
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0
        # computed on demand, kept until the next change
        self._line: tuple[float, float, float] | None = None
        self._observed: tuple[float, float] | None = None

    def add(self, at: float, x: float, y: float, limit: int) -> None:
        self.samples.append((at, x, y))
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y
        self.syy += y * y
        self._line = self._observed = None
        if self.ranked is not None:
            bisect.insort(self.ranked, y)
        if self.n > limit:
            self._drop()

    def expire(self, oldest: float) -> None:
        samples = self.samples
        while samples and samples[0][0] < oldest:
            self._drop()

    def _drop(self) -> None:
        _, x, y = self.samples.popleft()
        self.n -= 1
        self._line = self._observed = None
        if self.ranked is not None:
            del self.ranked[bisect.bisect_left(self.ranked, y)]
        if not self.n:  # start the sums afresh: no rounding carried over
            self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0
            return
        self.sx -= x
        self.sy -= y
        self.sxx -= x * x
        self.sxy -= x * y
        self.syy -= y * y

    def observed(self) -> tuple[float, float]:
        """``(P95 of seconds per token, mean load)`` of the samples (a ``ranked`` window)."""
        if self._observed is None:
            assert self.ranked is not None, "a window made with ranked=True"
            self._observed = (p95(self.ranked), self.sx / self.n)
        return self._observed

    def line(self) -> tuple[float, float, float]:
        """``(intercept, slope, residual sd)`` of seconds per token against load.

        The slope is never negative (more load never makes a server faster; a negative slope is
        noise); with one distinct load it is 0 and the line is the mean. Computed once per change.
        """
        if self._line is not None:
            return self._line
        n = self.n
        mean_x, mean_y = self.sx / n, self.sy / n
        var_x = self.sxx / n - mean_x * mean_x
        cov = self.sxy / n - mean_x * mean_y
        slope = max(0.0, cov / var_x) if var_x > 1e-9 else 0.0
        intercept = mean_y - slope * mean_x
        # residual variance = var(y) - 2 b cov + b^2 var(x), >= 0 up to rounding
        var_y = self.syy / n - mean_y * mean_y
        residual = var_y - 2 * slope * cov + slope * slope * max(var_x, 0.0)
        sd = math.sqrt(residual * n / (n - 1)) if n > 1 and residual > 0 else 0.0
        self._line = (intercept, slope, sd)
        return self._line


class LatencyTracker:
    """Per-output-token latency by (endpoint, target model), learnt from lifecycle events.

    Subscribe it to the lifecycle (``on_routed``, ``on_finished``) and to pool changes
    (``on_endpoints``: endpoints that leave are forgotten). ``clock`` is monotonic seconds.
    """

    __slots__ = (
        "_clock",
        "_fits",
        "_limit",
        "_load",
        "_min_samples",
        "_models",
        "_objective_load",
        "_objectives",
        "_pending",
        "_tails",
        "_window",
    )

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        window: float = 30.0,
        max_samples: int = 512,
        min_samples: int = 10,
    ) -> None:
        self._clock = clock
        self._window = window
        self._limit = max_samples
        self._min_samples = min_samples
        self._load = InFlight(clock)  # every request this EPP has in flight, per endpoint
        self._objective_load = InFlight(clock)  # those with a latency objective
        self._pending: dict[str, tuple[str, str, int]] = {}  # id -> endpoint, model, load
        self._fits: dict[str, _Window] = {}  # endpoint (and _POOL) -> samples
        self._tails: dict[tuple[str, str], _Window] = {}  # (endpoint, target model) -> samples
        self._objectives: dict[tuple[str, float], float] = {}  # (model, objective) -> last seen
        self._models: set[str] = set()  # target models with windows (at most MAX_MODELS)

    # -- events ---------------------------------------------------------------------------------

    def on_routed(self, event: Routed) -> None:
        request = event.request
        self._load.on_routed(event)
        self._pending[request.request_id] = (
            event.endpoint,
            kept(request.target_model),  # a client's name for an unknown model
            self._load.count(event.endpoint),
        )
        if request.latency_objective is not None:
            self._objective_load.on_routed(event)
            self._objectives[(request.target_model, request.latency_objective)] = self._clock()

    def on_finished(self, event: Finished) -> None:
        self._load.on_finished(event)
        self._objective_load.on_finished(event)
        routed = self._pending.pop(event.request_id, None)
        tokens, seconds = event.output_tokens, event.seconds
        if routed is None or not event.ok or not tokens or seconds is None or seconds <= 0:
            return
        endpoint, model, load = routed
        now, y = self._clock(), seconds / tokens
        for key, limit in ((endpoint, self._limit), (_POOL, self._limit * _POOL_LIMIT)):
            fit = self._fits.get(key)
            if fit is None:
                fit = self._fits[key] = _Window()
            fit.add(now, load, y, limit)
            tail = self._tails.get((key, model))
            if tail is None:
                if model not in self._models:
                    if len(self._models) >= MAX_MODELS:
                        continue
                    self._models.add(model)
                tail = self._tails[(key, model)] = _Window(ranked=True)
            tail.add(now, load, y, limit)

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        for endpoint in [e for e in self._fits if e != _POOL and e not in hostports]:
            del self._fits[endpoint]
        for key in [k for k in self._tails if k[0] != _POOL and k[0] not in hostports]:
            del self._tails[key]

    # -- reads ----------------------------------------------------------------------------------

    def load(self, endpoint: str) -> int:
        """Requests this EPP has in flight on ``endpoint`` (the fit's load)."""
        return self._load.count(endpoint)

    def objective_load(self, endpoint: str) -> int:
        """Requests with a latency objective this EPP has in flight on ``endpoint``."""
        return self._objective_load.count(endpoint)

    def samples(self, endpoint: str, model: str) -> int:
        """Samples of ``model`` on ``endpoint`` in the window."""
        tail = self._tails.get((endpoint, kept(model)))
        if tail is None:
            return 0
        tail.expire(self._clock() - self._window)
        return tail.n

    def observed(self, model: str) -> float | None:
        """The P95 of ``model``'s seconds per output token over the whole pool, in the window
        (the objective's own measure); None without samples."""
        tail = self._tails.get((_POOL, kept(model)))
        if tail is None:
            return None
        tail.expire(self._clock() - self._window)
        return tail.observed()[0] if tail.n else None

    def most_demanding(self) -> tuple[str, float] | None:
        """The target model with the tightest objective routed within the window, and it."""
        oldest = self._clock() - self._window
        for key in [k for k, seen in self._objectives.items() if seen < oldest]:
            del self._objectives[key]
        if not self._objectives:
            return None
        return min(self._objectives, key=lambda k: k[1])

    def predict(self, endpoint: str, model: str, load: float) -> float | None:
        """The P95 of seconds per output token that a ``model`` request routed to ``endpoint``
        at ``load`` (requests in flight there, itself included) should expect; None: no data."""
        return self._predict(endpoint, model, load, self._clock() - self._window)

    def predict_next(self, model: str, endpoints: Sequence[str]) -> list[float | None]:
        """``predict`` for one more ``model`` request on each endpoint, at its load now + 1."""
        oldest, count = self._clock() - self._window, self._load.count
        return [self._predict(e, model, count(e) + 1, oldest) for e in endpoints]

    def _predict(self, endpoint: str, model: str, load: float, oldest: float) -> float | None:
        line = self._line(endpoint, oldest)
        tail = self._tails.get((endpoint, kept(model)))
        if tail is not None:
            tail.expire(oldest)
            if not tail.n:
                tail = None
        if line is None:  # no fit means no samples anywhere, so no tail either
            return None
        intercept, slope, sd = line
        fitted = intercept + slope * load + Z_95 * sd
        if tail is None:
            return fitted if fitted > 0.0 else 0.0
        observed, observed_load = tail.observed()
        # the observation, moved along the slope from the load it met to today's
        observed += slope * (load - observed_load)
        if observed < 0.0:
            observed = 0.0
        weight = tail.n / self._min_samples
        if weight >= 1.0:
            return observed
        return weight * observed + (1.0 - weight) * (fitted if fitted > 0.0 else 0.0)

    def _line(self, endpoint: str, oldest: float) -> tuple[float, float, float] | None:
        """The endpoint's fitted line, or the pool's when it has no samples; None: no data."""
        for key in (endpoint, _POOL):
            window = self._fits.get(key)
            if window is None:
                continue
            window.expire(oldest)
            if window.n:
                return window.line()
        return None
