"""What the predicted-latency plugins share: a request's features on each endpoint (what it would
wait for and compute there), the prefix index they read its uncached tokens from, the adapters
routed and unfinished, the requests' latency objectives, and the one ``LatencyPredictor``
(``predictor.py``) they feed, subscribed to the lifecycle once however many plugins use it."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from endpoint_picker.requests import LLMRequest, priority_of
from endpoint_picker.scheduling.adapters import NO_ADAPTER, AdapterFlights, adapter_features
from endpoint_picker.scheduling.lifecycle import Finished, InFlight, Routed, remember
from endpoint_picker.scheduling.placement import Placement, RecentShares
from endpoint_picker.scheduling.predictor import LatencyPredictor, Prediction, PredictorObserver
from endpoint_picker.scheduling.prefix import (
    CHARS_PER_TOKEN,
    PrefixIndex,
    block_hashes,
    prompt_prefix_text,
)
from endpoint_picker.scheduling.registry import PluginContext
from endpoint_picker.types import EndpointState, ascii_int, is_base_model

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
MAX_OBJECTIVE_MS = 3_600_000  # an hour: a larger header value is ignored as malformed
PROMPT_CHARS = 512 * 1024  # prompt characters counted (about 128k tokens); hashing stops sooner
OBJECTIVE_WINDOW = 30.0  # seconds an objective seen on a request holds for its band
MAX_PRIORITIES = 64
_SHARED_KEY = "predicted-latency"
_TYPICAL_SMOOTHING = 0.02
_OUTPUT_LIMIT = 1_000_000  # output tokens a response may claim and still count (a server's word)


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


class PredictionSource:
    """Features of a request on each endpoint, and their predictions: the predictor, the prefix
    index it reads uncached tokens from, and the lifecycle feed of both (subscribed once, however
    many plugins share it)."""

    __slots__ = (
        "_adapter_of", "_block_chars", "_block_tokens", "_candidates", "_capacity", "_fallback",
        "_hashes", "_inflight", "_max_blocks", "_objectives", "_placement", "adapters", "index",
        "over_share", "placed", "predictor", "scored", "shares", "typical_ktok",
        "typical_output",
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
        self.shares = RecentShares()
        # the candidate (index) that rendezvous hashing of the prompt's first block names, for
        # the request last featured when no candidate holds any of its blocks; else None
        self.placed: int | None = None
        # for a new prefix, the candidates past their share of new prefixes (indexes)
        self.over_share: list[int] = []
        self._hashes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        # the adapter of each featured request that names one, until it is routed
        self._adapter_of: OrderedDict[str, str] = OrderedDict()
        self.typical_ktok = 0.0  # recent mean of routed requests' uncached prompt (ktok)
        self.typical_output = 0.0  # recent mean of finished requests' output tokens
        self.scored = False  # a predicted-latency-scorer features each request before routing
        self.adapters = AdapterFlights()
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
        self.placed = None
        self.over_share = []
        if hashes and hostports and not any(matched):  # by hash, among those under their share
            eligible = self.shares.eligible(hostports)
            pick = self._placement.pick(hashes[0], [hostports[i] for i in eligible])
            self.placed = eligible[pick]
            if len(eligible) < len(hostports):
                within = set(eligible)
                self.over_share = [i for i in range(len(hostports)) if i not in within]
        block_ktok = self._block_tokens / 1000.0
        base = is_base_model(request.target_model, endpoints)
        adapter = None if base else request.target_model
        if adapter is not None:  # decided once, among the candidates: routing counts it
            remember(self._adapter_of, request.request_id, adapter)
        adapters = adapter_features(adapter, endpoints, self.adapters)
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
        return self._load_features(e, self.typical_ktok, NO_ADAPTER)

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
        adapter = self._adapter_of.pop(request.request_id, None)
        if adapter is not None:
            self.adapters.routed(request.request_id, event.endpoint, adapter)
        hashes = self._hashes.pop(request.request_id, None)
        if hashes:
            if not self.index.held(hashes[0]):
                self.shares.add(event.endpoint)
            self.index.insert(event.endpoint, hashes, self._capacity_of(event.endpoint))
        self.predictor.on_routed(event)
        flight_ktok = self.predictor.routed_uncached(event.request.request_id)
        if flight_ktok is not None:
            self.typical_ktok += _TYPICAL_SMOOTHING * (flight_ktok - self.typical_ktok)

    def on_started(self, request_id: str) -> None:
        self.predictor.on_started(request_id)

    def on_finished(self, event: Finished) -> None:
        tokens = event.output_tokens
        if event.ok and tokens is not None and 0 < tokens <= _OUTPUT_LIMIT:
            self.typical_output += _TYPICAL_SMOOTHING * (tokens - self.typical_output)
        self._hashes.pop(event.request_id, None)
        self._adapter_of.pop(event.request_id, None)
        self.adapters.finished(event.request_id)
        self.predictor.on_finished(event)

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        self.index.purge(hostports)
        self.shares.purge(hostports)
        self.adapters.on_endpoints(hostports)
        for gone in [h for h in self._capacity if h not in hostports]:
            del self._capacity[gone]
        self.predictor.on_endpoints(hostports)
