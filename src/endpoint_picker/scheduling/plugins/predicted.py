"""Routing and admission by predicted latency: ``predicted-latency-scorer`` and
``predicted-latency-detector``, over one shared ``LatencyPredictor`` (``scheduling/predictor.py``).

The scorer predicts, for the request at hand, its TTFT (and TPOT) on every candidate from what it
would wait for and compute there, and scores ``best cost / cost`` (cost: the mean predicted TTFT
plus ``tpotWeight`` x the predicted TPOT), so the endpoint predicted fastest scores 1.0: a cached
prefix behind a short queue and an idle server without the prefix are compared in seconds, not
weighed by hand. A request with an objective (``x-slo-ttft-ms`` / ``x-slo-tpot-ms``) ranks the
endpoints predicted (P90) to meet it above those that are not.

The detector judges a priority band by a *typical* request (the recent mean of routed requests'
prompt tokens, uncached): an endpoint has room for a band when that request's predicted TTFT P90
there is within the band's objective; the pool is saturated for the band when no endpoint has.
Without an objective set, Critical's is ``criticalFactor`` x the request's predicted TTFT on the
same endpoint unloaded (at least the endpoint's fastest observed first tokens, about their 10th
percentile), and lower bands' ``factor`` x that (smaller: they stop first, so the room that is
left is Critical's).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from endpoint_picker.errors import ConfigError
from endpoint_picker.requests import LLMRequest, priority_of
from endpoint_picker.scheduling.prediction import (
    TPOT_HEADER,
    TTFT_HEADER,
    PredictionSource,
    request_objectives,
)
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.scheduling.saturation import UtilizationDetector
from endpoint_picker.types import EndpointState

PLACEMENT_PREFERENCE = 0.05  # a new prefix's placed endpoint wins within 5% of the best cost


class PredictedLatencyScorer:
    """``best cost / cost`` per endpoint, cost = predicted TTFT (at least the endpoint's
    head-of-line wait) + (``tpotWeight`` + ``decodeWeight`` x a typical response's tokens) x
    TPOT + ``othersWeight`` x the delay its prefill adds to the requests there; with an
    objective, endpoints predicted (P90) to meet it score in [0.5, 1], the others below."""

    __slots__ = (
        "_clock", "_decode", "_head_wait", "_others", "_source", "_tpot_weight", "request_headers",
    )  # fmt: skip

    def __init__(
        self,
        source: PredictionSource,
        tpot_weight: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        others_weight: float = 1.0,
        head_wait: bool = True,
        decode_weight: float = 0.0,
    ) -> None:
        self._decode = decode_weight
        self._source = source
        self._head_wait = head_wait
        source.scored = True
        self._tpot_weight = tpot_weight
        self._others = others_weight
        self._clock = clock
        self.request_headers = frozenset({TTFT_HEADER, TPOT_HEADER})

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> PredictedLatencyScorer:
        source = PredictionSource.shared(ctx)
        # new prefixes go by hash among the endpoints within this share of the mean (placement.py)
        source.shares.slack = params.number("placementSlack", 0.1, minimum=0.0, maximum=1000.0)
        return cls(
            source,
            params.number("tpotWeight", 1.0, minimum=0.0, maximum=10_000.0),
            ctx.clock,
            others_weight=params.number("othersWeight", 1.0, minimum=0.0, maximum=10_000.0),
            head_wait=params.boolean("headOfLineWait", True),
            decode_weight=params.number("decodeWeight", 0.0, minimum=0.0, maximum=10_000.0),
        )

    @property
    def source(self) -> PredictionSource:
        return self._source

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        source = self._source
        features = source.features(request, endpoints)
        predictor = source.predictor
        means, head_wait = predictor.means, predictor.head_wait
        floor = self._head_wait
        # the whole decode it joins (TPOT x a typical response's tokens): a slower server's
        # steps, which a TTFT-first cost does not see once the request's prefix is cached there
        w, others = self._tpot_weight + self._decode * source.typical_output, self._others
        # The request's own prefill also holds up every request waiting or running there (one
        # longer step each): the latency it adds to the others, in seconds, counts too.
        costs = []
        for e, (x, tx) in zip(endpoints, features, strict=True):
            ttft, tpot, prefill = means(e.hostport, x, tx)
            if floor:  # a queue builds before its waits teach the fit
                wait = head_wait(e.hostport)
                ttft = ttft if ttft > wait else wait
            costs.append(ttft + w * tpot + others * prefill * 10.0 * (x[3] + x[4]))
        if source.placed is not None:  # a new prefix: near-equal costs go where every replica
            costs[source.placed] *= 1.0 - PLACEMENT_PREFERENCE  # would send it (placement.py)
            # and never to an endpoint past its share of new prefixes: one that looks idle at
            # a cold start would otherwise take more prefixes than it can serve once they recur
            for i in source.over_share:
                costs[i] = math.inf
        ttft_objective, tpot_objective = request_objectives(request)
        if ttft_objective is None and tpot_objective is None:
            best = min(costs)
            return [best / c for c in costs]
        source.note_objectives(priority_of(request), ttft_objective, tpot_objective, self._clock())
        predictions = [
            source.predict(e.hostport, f) for e, f in zip(endpoints, features, strict=True)
        ]
        meets = [
            (ttft_objective is None or p.ttft_p90 <= ttft_objective)
            and (tpot_objective is None or p.tpot_p90 <= tpot_objective)
            for p in predictions
        ]
        best_meeting = min(
            (c for c, ok in zip(costs, meets, strict=True) if ok and c < math.inf), default=None
        )
        best = min(costs)
        return [
            0.5 + 0.5 * best_meeting / c if ok and best_meeting is not None else 0.5 * best / c
            for c, ok in zip(costs, meets, strict=True)
        ]


class PredictedLatencyDetector:
    """Per priority band: room on an endpoint while a typical request's predicted TTFT P90 there
    is within the band's objective (see the module docstring)."""

    __slots__ = ("_clock", "_critical", "_factor", "_source", "_staleness", "_utilization")

    def __init__(
        self,
        source: PredictionSource,
        *,
        factor: float,
        critical_factor: float,
        staleness: float,
        clock: Callable[[], float],
        utilization: UtilizationDetector | None = None,
    ) -> None:
        """``utilization``: thresholds an endpoint must pass first (the waiting queue, KV)."""
        self._utilization = utilization
        self._source = source
        self._factor = factor
        self._critical = critical_factor
        self._staleness = staleness
        self._clock = clock

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> PredictedLatencyDetector:
        factor = params.number("factor", 2.0, minimum=1.0, maximum=1000.0)
        critical = params.number("criticalFactor", 3.0, minimum=1.0, maximum=1000.0)
        if critical < factor:
            raise ConfigError(
                f"must be at least factor ({factor:g}): Critical requests never get less room "
                f"than the others, got {critical:g}",
                params.path("criticalFactor"),
            )
        staleness = params.duration("metricsStalenessThreshold", 0.2)
        return cls(
            PredictionSource.shared(ctx),
            factor=factor,
            critical_factor=critical,
            staleness=staleness,
            clock=ctx.clock,
            utilization=UtilizationDetector(
                queue_depth_threshold=params.number("queueDepthThreshold", 0, minimum=0),
                kv_cache_util_threshold=params.number("kvCacheUtilThreshold", 1.0, minimum=0),
                metrics_staleness_threshold=staleness,
                clock=ctx.clock,
                inflight=ctx.inflight,
            ),
        )

    def is_saturated(self, candidates: Sequence[EndpointState]) -> bool:
        return not self.with_room_for(candidates, 0)

    def with_room(self, candidates: Sequence[EndpointState]) -> Sequence[EndpointState]:
        return self.with_room_for(candidates, 0)

    def with_room_for(
        self, candidates: Sequence[EndpointState], priority: int
    ) -> Sequence[EndpointState]:
        now = self._clock()
        oldest = now - self._staleness
        critical = priority > 0
        factor = self._critical if critical else self._factor
        source = self._source
        ttft_objective, tpot_objective = source.objectives(priority, now)
        source.seen(candidates)
        if self._utilization is not None:
            candidates = self._utilization.with_room_for(candidates, priority)
        room = []
        for e in candidates:
            if e.metrics.updated_at < oldest:
                continue  # an endpoint we cannot see may be drowning
            p = source.predict(e.hostport, source.typical_features(e))
            unloaded = source.predict(e.hostport, source.typical_features(e, True)).ttft_p90
            bound = factor * max(unloaded, source.predictor.fast_ttft(e.hostport))
            if ttft_objective is not None:  # Critical: its own; the others: never looser
                bound = ttft_objective if critical else min(bound, ttft_objective)
            if p.ttft_p90 <= bound and (tpot_objective is None or p.tpot_p90 <= tpot_objective):
                room.append(e)
        return room
