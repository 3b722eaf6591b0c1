"""Plugins that learn from the EPP's own traffic: prefix-cache affinity, and the load bound
that keeps affinity from making a hot spot.

Affinity alone is a trap: a popular prefix would pile onto the one server that cached it
while the others idle. ``bounded-load-filter`` runs first and removes every endpoint whose load
is past a bound relative to the pool (consistent hashing with bounded loads, in spirit), so
``prefix-cache-scorer`` only chooses among endpoints with room; when the best holder of a prefix
is full, the request lands elsewhere and that endpoint becomes a second home for the prefix.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.lifecycle import Finished, InFlight, Routed, remember
from endpoint_picker.scheduling.placement import (
    RING_CHOICES,
    Placement,
    RingWalk,
)
from endpoint_picker.scheduling.prefix import (
    CHARS_PER_TOKEN,
    PrefixIndex,
    PrefixObserver,
    block_hashes,
    prompt_prefix_text,
)
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.types import EndpointState

_HINTED_HOLDERS = 16  # holders of a prefix a sampled pool keeps among its candidates


def endpoint_loads(endpoints: Sequence[EndpointState], inflight: InFlight) -> list[int]:
    """Requests on each endpoint: the EPP's own in-flight count (fresh), or what the server
    reports running and waiting when that is more (traffic from other EPP replicas). One loop
    without a call per endpoint but the count: with a thousand endpoints this is the
    costliest part of a pick."""
    count = inflight.count
    loads = []
    for state in endpoints:
        metrics = state.metrics
        scraped = metrics.running_requests + metrics.waiting_queue_size
        own = count(state.endpoint.hostport)
        loads.append(own if own > scraped else scraped)
    return loads


class BoundedLoadFilter:
    """Keeps the endpoints whose load is at most ``max(factor x mean, min + slack)``.

    The mean and the minimum are over the candidates. ``slack`` keeps a lightly loaded pool
    free to follow affinity (one or two requests of difference mean nothing); ``factor`` bounds
    how far above the mean any endpoint may be pushed by affinity.

    With ``smoothing`` (a time constant, seconds), that bound applies to each endpoint's load
    averaged over about that long (an exponentially weighted moving average, decayed by the time
    between picks), so the ordinary ups and downs of a few requests under even traffic no longer
    send a request away from its prefix's holder, where it pays a full prefill; a sustained hot
    spot still crosses the bound within about ``smoothing``. Meanwhile the instantaneous load is
    held to ``max(burstFactor x mean, min + slack)``, so a sudden burst on one prefix cannot
    pile up while the average catches up.
    """

    __slots__ = (
        "_averages",
        "_burst",
        "_clock",
        "_factor",
        "_inflight",
        "_picks",
        "_slack",
        "_tau",
    )

    _PRUNE_EVERY = 4096  # picks between sweeps of the averages of endpoints no longer seen
    _FORGET_AFTER = 60.0  # seconds without a pick before an endpoint's average is dropped

    def __init__(
        self,
        factor: float,
        slack: int,
        inflight: InFlight,
        *,
        smoothing: float = 0.0,
        burst_factor: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factor = factor
        self._slack = slack
        self._inflight = inflight
        self._tau = smoothing
        self._burst = burst_factor
        self._clock = clock
        self._averages: dict[str, tuple[float, float]] = {}  # hostport -> (average, updated at)
        self._picks = 0

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> BoundedLoadFilter:
        factor = params.number("factor", 1.25, minimum=1.0)
        return cls(
            factor,
            params.integer("slack", 2, minimum=0),
            ctx.inflight,
            smoothing=params.duration("smoothing", 0.0),
            burst_factor=params.number("burstFactor", max(2.0, factor), minimum=factor),
            clock=ctx.clock,
        )

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        loads = endpoint_loads(endpoints, self._inflight)
        if self._tau <= 0.0:
            bound = self._bound(self._factor, loads)
            return [e for e, load in zip(endpoints, loads, strict=True) if load <= bound]
        averages = self._smooth(endpoints, loads)
        bound, burst = self._bound(self._factor, averages), self._bound(self._burst, loads)
        return [
            e
            for e, load, average in zip(endpoints, loads, averages, strict=True)
            if average <= bound and load <= burst
        ]

    def _bound(self, factor: float, loads: Sequence[float]) -> float:
        return max(factor * sum(loads) / len(loads), min(loads) + self._slack)

    def _smooth(self, endpoints: Sequence[EndpointState], loads: list[int]) -> list[float]:
        """Each endpoint's moving average, updated with its load now."""
        now = self._clock()
        tau = self._tau
        table = self._averages
        weights: dict[float, float] = {}  # most endpoints share their last update time
        out = []
        for state, load in zip(endpoints, loads, strict=True):
            key = state.endpoint.hostport
            entry = table.get(key)
            if entry is None:
                average = float(load)
            else:
                previous, since = entry
                weight = weights.get(since)
                if weight is None:
                    weight = weights[since] = math.exp(-max(now - since, 0.0) / tau)
                average = load + (previous - load) * weight
            table[key] = (average, now)
            out.append(average)
        self._picks += 1
        if self._picks % self._PRUNE_EVERY == 0:
            horizon = now - max(self._FORGET_AFTER, 10 * tau)
            for key in [k for k, (_, since) in table.items() if since < horizon]:
                del table[key]
        return out


class InFlightLoadScorer:
    """Prefers the least-loaded endpoints (``endpoint_loads``): min-max normalised, inverted.

    Between scrapes every endpoint looks as it did at the last one; the in-flight count moves
    with each routed request, so a burst spreads instead of landing on one idle-looking server.
    """

    __slots__ = ("_inflight",)

    def __init__(self, inflight: InFlight) -> None:
        self._inflight = inflight

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> InFlightLoadScorer:
        return cls(ctx.inflight)

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        loads = endpoint_loads(endpoints, self._inflight)
        low, high = min(loads), max(loads)
        if high == low:
            return [1.0] * len(loads)
        spread = high - low
        return [1.0 - (load - low) / spread for load in loads]


class PrefixCacheScorer:
    """Scores each endpoint by how much of the request's prompt prefix it likely caches.

    Score = leading blocks the endpoint holds / the request's blocks (at most
    ``maxPrefixBlocksToMatch``). The index learns from the EPP's own decisions: when a request
    is routed, its blocks are recorded for that endpoint. Each endpoint's entries live in an LRU
    sized like its KV cache (``vllm:cache_config_info``: ``num_gpu_blocks`` x ``block_size``
    tokens, in blocks of ``blockSizeTokens``), or ``lruCapacityPerServer`` until it reports one.

    A prefix no candidate holds (not even its first block) is placed (``deterministicPlacement``,
    on by default): the endpoint chosen by rendezvous hashing of its first block's hash scores
    1.0, so every replica sends a new prefix to the same endpoint (see ``placement.py``).
    """

    __slots__ = (
        "_block_chars",
        "_candidates",
        "_capacity",
        "_fallback",
        "_index",
        "_max_blocks",
        "_observer",
        "_pending",
        "_placed",
        "_placement",
        "_rng",
    )

    def __init__(
        self,
        block_tokens: int,
        max_blocks: int,
        lru_capacity: int,
        observer: PrefixObserver | None = None,
        placement: bool = True,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._observer = observer
        self._rng = rng if rng is not None else random.Random()
        self._placement = Placement() if placement else None
        self._block_chars = block_tokens * CHARS_PER_TOKEN
        self._max_blocks = max_blocks
        self._fallback = lru_capacity
        self._index = PrefixIndex()
        self._capacity: dict[str, int] = {}  # per endpoint, from its metrics
        self._candidates: Sequence[EndpointState] = ()  # of the last request scored
        self._pending: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        # requests of a sampled pool: their prefix's place on the ring (see ``preferred``)
        self._placed: OrderedDict[str, list[str]] = OrderedDict()
        if observer is not None:
            index = self._index
            observer.track_prefix_index(lambda: float(index.size))

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> PrefixCacheScorer:
        return cls(
            params.integer("blockSizeTokens", 64, minimum=1),
            params.integer("maxPrefixBlocksToMatch", 256, minimum=1),
            params.integer("lruCapacityPerServer", 31_250, minimum=1),
            ctx.observer if isinstance(ctx.observer, PrefixObserver) else None,
            params.boolean("deterministicPlacement", True),
            rng=ctx.rng,
        )

    @property
    def index(self) -> PrefixIndex:
        return self._index

    def hashes(self, request: LLMRequest) -> tuple[int, ...]:
        limit = self._block_chars * self._max_blocks
        text = prompt_prefix_text(request, limit)
        return block_hashes(request.target_model, text, self._block_chars, self._max_blocks)

    def _hashes_of(self, request: LLMRequest) -> tuple[int, ...]:
        """The request's block hashes, computed once per request (kept until it is routed)."""
        hashes = self._pending.get(request.request_id)
        if hashes is None:
            hashes = self.hashes(request)
            remember(self._pending, request.request_id, hashes)
        return hashes

    def preferred(self, request: LLMRequest, ring: RingWalk) -> Iterable[str]:
        """For a sampled pool: some of the endpoints holding the longest run of the prompt's
        blocks, and the first endpoints of the prefix's place on ``ring`` (placement)."""
        hashes = self._hashes_of(request)
        if not hashes:
            return ()
        preferred = self._index.leading_holders(hashes, _HINTED_HOLDERS, self._rng)
        if self._placement is not None:
            order = ring.walk(hashes[0], RING_CHOICES)
            remember(self._placed, request.request_id, order)
            preferred.update(order)
        return preferred

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        hashes = self._hashes_of(request)
        placed = self._placed.pop(request.request_id, None) if self._placed else None
        # Only the routed endpoint's capacity is needed (on_routed): keep the candidates, not
        # a pass over every endpoint's metrics per pick (a large pool's hottest line).
        self._candidates = endpoints
        if not hashes:
            return [0.0] * len(endpoints)
        total = len(hashes)
        hostports = [e.hostport for e in endpoints]
        matched = self._index.match(hashes, hostports)
        scores = [m / total for m in matched]
        best = max(scores)
        if self._observer is not None:
            self._observer.prefix_hit_ratio_observed(best)
        if best == 0.0 and self._placement is not None:
            place = self._placement.place(hashes[0], placed, hostports)
            if place is not None:
                scores[place] = 1.0
        return scores

    def on_routed(self, event: Routed) -> None:
        hashes = self._pending.pop(event.request.request_id, None)
        if hashes is None:
            hashes = self.hashes(event.request)
        if hashes:
            self._index.insert(event.endpoint, hashes, self._capacity_of(event.endpoint))

    def _capacity_of(self, hostport: str) -> int:
        """The endpoint's LRU capacity in blocks: from the metrics it last reported among the
        candidates last scored (it was routed from them), else as known, else the fallback."""
        for e in self._candidates:
            if e.hostport == hostport:
                m = e.metrics
                if m.num_gpu_blocks and m.block_size:
                    tokens = m.num_gpu_blocks * m.block_size
                    self._capacity[hostport] = max(1, tokens * CHARS_PER_TOKEN // self._block_chars)
                break
        return self._capacity.get(hostport, self._fallback)

    def on_finished(self, event: Finished) -> None:
        self._pending.pop(event.request_id, None)
        self._placed.pop(event.request_id, None)

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        self._index.purge(hostports)
        for gone in [e for e in self._capacity if e not in hostports]:
            del self._capacity[gone]
