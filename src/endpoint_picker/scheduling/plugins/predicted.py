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
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from endpoint_picker.errors import ConfigError
from endpoint_picker.requests import LLMRequest, priority_of
from endpoint_picker.scheduling.lifecycle import Finished, InFlight, Routed, remember
from endpoint_picker.scheduling.placement import Placement
from endpoint_picker.scheduling.plugins.scorers import is_base_model
from endpoint_picker.scheduling.predictor import LatencyPredictor, Prediction, PredictorObserver
from endpoint_picker.scheduling.prefix import (
    CHARS_PER_TOKEN,
    PrefixIndex,
    block_hashes,
    prompt_prefix_text,
)
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.scheduling.saturation import UtilizationDetector
from endpoint_picker.types import EndpointState, ascii_int

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
MAX_OBJECTIVE_MS = 3_600_000  # an hour: a larger header value is ignored as malformed
PROMPT_CHARS = 512 * 1024  # prompt characters counted (about 128k tokens); hashing stops sooner
PLACEMENT_PREFERENCE = 0.05  # a new prefix's placed endpoint wins within 5% of the best cost
OBJECTIVE_WINDOW = 30.0  # seconds an objective seen on a request holds for its band
MAX_PRIORITIES = 64
_SHARED_KEY = "predicted-latency"
_TYPICAL_SMOOTHING = 0.02


def header_objectives(headers: Mapping[str, str]) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) objectives in seconds from ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``: ASCII
    digits only, 1 ms to an hour; anything else is ignored (None), never an error."""
    out: list[float | None] = []
    for name in (TTFT_HEADER, TPOT_HEADER):
        text = headers.get(name)
        ms = ascii_int(text, MAX_OBJECTIVE_MS) if text is not None else None
        out.append(ms / 1000.0 if ms else None)
    return out[0], out[1]


def request_objectives(request: LLMRequest) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) objectives in seconds: the headers', else for TPOT the seed's per-model (or
    InferenceObjective's) latency per output token, which bounds TPOT from above."""
    ttft, tpot = header_objectives(request.headers) if request.headers else (None, None)
    if tpot is None and request.latency_objective is not None:
        tpot = request.latency_objective
    return ttft, tpot


Features = tuple[tuple[float, ...], tuple[float, ...]]  # (TTFT's, TPOT's)
_NO_ADAPTER = (0.0, 0.0)
_LOAD = (1.0, 0.0)
_LOAD_AFTER_WAIT = (1.0, 1.0)


def adapter_features(model: str, endpoints: Sequence[EndpointState]) -> list[tuple[float, float]]:
    """Per endpoint, (must load ``model``'s adapter, must first wait for a slot): nothing for a
    base-model request or an adapter running there; a load where a slot is free (or the server
    reports no LoRA state: a fresh pod); a load after a wait where every slot is taken. The
    predictor learns what each costs on each endpoint (``adapter_load``, ``adapter_wait``)."""
    if is_base_model(model, endpoints):
        return [_NO_ADAPTER] * len(endpoints)
    return [
        _NO_ADAPTER
        if model in m.active_adapters
        else _LOAD
        if m.max_active_adapters is None
        or len(m.active_adapters) + len(m.waiting_adapters) < m.max_active_adapters
        else _LOAD_AFTER_WAIT
        for e in endpoints
        for m in (e.metrics,)
    ]


class PredictionSource:
    """Features of a request on each endpoint, and their predictions: the predictor, the prefix
    index it reads uncached tokens from, and the lifecycle feed of both (subscribed once, however
    many plugins share it)."""

    __slots__ = (
        "_block_chars", "_block_tokens", "_candidates", "_capacity", "_fallback", "_hashes",
        "_inflight", "_max_blocks", "_objectives", "_placement", "index", "placed", "predictor",
        "scored", "typical_ktok",
    )  # fmt: skip

    def __init__(
        self,
        predictor: LatencyPredictor,
        inflight: InFlight,
        *,
        block_tokens: int = 64,
        max_blocks: int = 256,
        lru_capacity: int = 31_250,
    ) -> None:
        self.predictor = predictor
        self._inflight = inflight
        self._block_tokens = block_tokens
        self._block_chars = block_tokens * CHARS_PER_TOKEN
        self._max_blocks = max_blocks
        self._fallback = lru_capacity
        self.index = PrefixIndex()
        self._capacity: dict[str, int] = {}
        self._candidates: Sequence[EndpointState] = ()  # of the last request scored
        self._placement = Placement()
        # the candidate (index) that rendezvous hashing of the prompt's first block names, for
        # the request last featured when no candidate holds any of its blocks; else None
        self.placed: int | None = None
        self._hashes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.typical_ktok = 0.0  # recent mean of routed requests' uncached prompt (ktok)
        self.scored = False  # a predicted-latency-scorer features each request before routing
        # per priority: the tightest (TTFT, TPOT) objectives of its recent requests, with when
        # each was last seen (priorities come from the config: bounded, and capped anyway)
        self._objectives: dict[int, list[float]] = {}

    @classmethod
    def shared(cls, ctx: PluginContext) -> PredictionSource:
        """The build's one source (the scorer and the detector share it)."""
        source = ctx.shared.get(_SHARED_KEY)
        if not isinstance(source, PredictionSource):
            source = cls(LatencyPredictor(ctx.clock), ctx.inflight)
            ctx.shared[_SHARED_KEY] = source
            if isinstance(ctx.observer, PredictorObserver):
                ctx.observer.track_latency_predictor(source.predictor.errors)
        return source

    def features(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> list[Features]:
        """Each endpoint's (TTFT, TPOT) features for ``request``; remembers them (and the
        prompt's hashes) for when it is routed."""
        text = prompt_prefix_text(request, PROMPT_CHARS)
        prompt_ktok = len(text) / CHARS_PER_TOKEN / 1000.0
        hashes = block_hashes(request.target_model, text, self._block_chars, self._max_blocks)
        remember(self._hashes, request.request_id, hashes)
        hostports = [e.hostport for e in endpoints]
        matched = self.index.match(hashes, hostports) if hashes else [0] * len(hostports)
        self.placed = (
            self._placement.pick(hashes[0], hostports) if hashes and not any(matched) else None
        )
        block_ktok = self._block_tokens / 1000.0
        adapters = adapter_features(request.target_model, endpoints)
        out = [
            self._load_features(e, max(0.0, prompt_ktok - m * block_ktok), a)
            for e, m, a in zip(endpoints, matched, adapters, strict=True)
        ]
        self._candidates = endpoints  # the routed one's capacity is read on routing
        self.predictor.expect(request.request_id, dict(zip(hostports, out, strict=True)))
        return out

    def note_objectives(
        self, priority: int, ttft: float | None, tpot: float | None, now: float
    ) -> None:
        """A request of ``priority`` carried these objectives (seconds)."""
        entry = self._objectives.get(priority)
        if entry is None:
            if len(self._objectives) >= MAX_PRIORITIES:
                return
            entry = self._objectives[priority] = [math.inf, -math.inf, math.inf, -math.inf]
        for i, value in ((0, ttft), (2, tpot)):
            if value is None:
                continue
            if value <= entry[i] or now - entry[i + 1] > OBJECTIVE_WINDOW:
                entry[i] = value  # tighter, or the tightest one expired: the latest
            if value <= entry[i]:
                entry[i + 1] = now

    def objectives(self, priority: int, now: float) -> tuple[float | None, float | None]:
        """The tightest (TTFT, TPOT) objectives of ``priority``'s requests seen within
        ``OBJECTIVE_WINDOW``."""
        entry = self._objectives.get(priority)
        if entry is None:
            return None, None
        ttft = entry[0] if now - entry[1] <= OBJECTIVE_WINDOW else None
        tpot = entry[2] if now - entry[3] <= OBJECTIVE_WINDOW else None
        return ttft, tpot

    def typical_features(self, e: EndpointState, unloaded: bool = False) -> Features:
        """A typical request's features on ``e`` (the recent mean uncached prompt), as the pool
        is now or, with ``unloaded``, with nothing else on it."""
        if unloaded:
            ktok = self.typical_ktok
            return (1.0, ktok, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), (1.0, 0.1, 0.0, 0.0)
        return self._load_features(e, self.typical_ktok, _NO_ADAPTER)

    def _load_features(
        self, e: EndpointState, uncached_ktok: float, adapter: tuple[float, float]
    ) -> Features:
        m = e.metrics
        ahead_ktok, unstarted = self.predictor.ahead(e.hostport)
        waiting = m.waiting_queue_size
        if waiting > unstarted:  # queued by others (other replicas): assume typical prompts
            ahead_ktok += (waiting - unstarted) * self.typical_ktok
        else:
            waiting = unstarted
        running = max(m.running_requests, self._inflight.count(e.hostport) - unstarted)
        kv = m.kv_cache_usage
        return (
            (1.0, uncached_ktok, ahead_ktok, waiting / 10.0, running / 10.0, kv, *adapter),
            (1.0, (running + waiting + 1) / 10.0, ahead_ktok, kv),
        )

    def predict(self, hostport: str, features: Features) -> Prediction:
        return self.predictor.predict(hostport, features[0], features[1])

    def _capacity_of(self, hostport: str) -> int:
        """The endpoint's prefix-index capacity in blocks: from the metrics it reported among
        the candidates last scored, else as known, else the fallback."""
        for e in self._candidates:
            if e.hostport == hostport:
                m = e.metrics
                if m.num_gpu_blocks and m.block_size:
                    tokens = m.num_gpu_blocks * m.block_size
                    self._capacity[hostport] = max(1, tokens // self._block_tokens)
                break
        return self._capacity.get(hostport, self._fallback)

    # -- lifecycle --------------------------------------------------------------------------

    def seen(self, candidates: Sequence[EndpointState]) -> None:
        """The candidates the detector judged last: with no scorer to feature requests, routed
        requests are featured on routing from these (so the detector learns alone)."""
        if not self.scored:
            self._candidates = candidates

    def on_routed(self, event: Routed) -> None:
        request = event.request
        if not self.scored and request.request_id not in self._hashes:
            routed = [e for e in self._candidates if e.hostport == event.endpoint]
            if routed:
                self.features(request, routed)
            ttft, tpot = request_objectives(request)
            if ttft is not None or tpot is not None:
                self.note_objectives(priority_of(request), ttft, tpot, self.predictor.now())
        hashes = self._hashes.pop(request.request_id, None)
        if hashes:
            self.index.insert(event.endpoint, hashes, self._capacity_of(event.endpoint))
        self.predictor.on_routed(event)
        flight_ktok = self.predictor.routed_uncached(event.request.request_id)
        if flight_ktok is not None:
            self.typical_ktok += _TYPICAL_SMOOTHING * (flight_ktok - self.typical_ktok)

    def on_started(self, request_id: str) -> None:
        self.predictor.on_started(request_id)

    def on_finished(self, event: Finished) -> None:
        self._hashes.pop(event.request_id, None)
        self.predictor.on_finished(event)

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        self.index.purge(hostports)
        for gone in [h for h in self._capacity if h not in hostports]:
            del self._capacity[gone]
        self.predictor.on_endpoints(hostports)


class PredictedLatencyScorer:
    """``best cost / cost`` per endpoint, cost = predicted TTFT + ``tpotWeight`` x TPOT; with
    an objective, endpoints predicted (P90) to meet it score in [0.5, 1], the others below."""

    __slots__ = ("_clock", "_others", "_source", "_tpot_weight", "request_headers")

    def __init__(
        self,
        source: PredictionSource,
        tpot_weight: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        others_weight: float = 1.0,
    ) -> None:
        self._source = source
        source.scored = True
        self._tpot_weight = tpot_weight
        self._others = others_weight
        self._clock = clock
        self.request_headers = frozenset({TTFT_HEADER, TPOT_HEADER})

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> PredictedLatencyScorer:
        return cls(
            PredictionSource.shared(ctx),
            params.number("tpotWeight", 1.0, minimum=0.0, maximum=10_000.0),
            ctx.clock,
            others_weight=params.number("othersWeight", 1.0, minimum=0.0, maximum=10_000.0),
        )

    @property
    def source(self) -> PredictionSource:
        return self._source

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        source = self._source
        features = source.features(request, endpoints)
        means = source.predictor.means
        w, others = self._tpot_weight, self._others
        # The request's own prefill also holds up every request waiting or running there (one
        # longer step each): the latency it adds to the others, in seconds, counts too.
        costs = []
        for e, (x, tx) in zip(endpoints, features, strict=True):
            ttft, tpot, prefill = means(e.hostport, x, tx)
            costs.append(ttft + w * tpot + others * prefill * 10.0 * (x[3] + x[4]))
        if source.placed is not None:  # a new prefix: near-equal costs go where every replica
            costs[source.placed] *= 1.0 - PLACEMENT_PREFERENCE  # would send it (placement.py)
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
        best_meeting = min((c for c, ok in zip(costs, meets, strict=True) if ok), default=None)
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
