"""Plugins that learn from the EPP's own traffic: prefix-cache affinity, and the load bound
that keeps affinity from making a hot spot.

Affinity alone is a trap: a popular prefix would pile onto the one server that cached it
while the others idle. ``bounded-load-filter`` runs first and removes every endpoint whose load
is past a bound relative to the pool (consistent hashing with bounded loads, in spirit), so
``prefix-cache-scorer`` only chooses among endpoints with room; when the best holder of a prefix
is full, the request lands elsewhere and that endpoint becomes a second home for the prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.lifecycle import Finished, InFlight, Routed
from endpoint_picker.scheduling.placement import Placement
from endpoint_picker.scheduling.prefix import (
    CHARS_PER_TOKEN,
    PrefixIndex,
    PrefixObserver,
    block_hashes,
    prompt_prefix_text,
)
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.types import EndpointState

_PENDING_LIMIT = 10_000  # requests scored but not yet routed or finished (hashes kept for them)


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
    """

    __slots__ = ("_factor", "_inflight", "_slack")

    def __init__(self, factor: float, slack: int, inflight: InFlight) -> None:
        self._factor = factor
        self._slack = slack
        self._inflight = inflight

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> BoundedLoadFilter:
        return cls(
            params.number("factor", 1.25, minimum=1.0),
            params.integer("slack", 2, minimum=0),
            ctx.inflight,
        )

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        loads = endpoint_loads(endpoints, self._inflight)
        bound = max(self._factor * sum(loads) / len(loads), min(loads) + self._slack)
        return [e for e, load in zip(endpoints, loads, strict=True) if load <= bound]


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
        "_capacity",
        "_fallback",
        "_index",
        "_max_blocks",
        "_observer",
        "_pending",
        "_placement",
    )

    def __init__(
        self,
        block_tokens: int,
        max_blocks: int,
        lru_capacity: int,
        observer: PrefixObserver | None = None,
        placement: bool = True,
    ) -> None:
        self._observer = observer
        self._placement = Placement() if placement else None
        self._block_chars = block_tokens * CHARS_PER_TOKEN
        self._max_blocks = max_blocks
        self._fallback = lru_capacity
        self._index = PrefixIndex()
        self._capacity: dict[str, int] = {}  # per endpoint, from its metrics
        self._pending: OrderedDict[str, tuple[int, ...]] = OrderedDict()
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
        )

    @property
    def index(self) -> PrefixIndex:
        return self._index

    def hashes(self, request: LLMRequest) -> tuple[int, ...]:
        limit = self._block_chars * self._max_blocks
        text = prompt_prefix_text(request, limit)
        return block_hashes(request.target_model, text, self._block_chars, self._max_blocks)

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        hashes = self._pending.get(request.request_id)
        if hashes is None:
            hashes = self.hashes(request)
            self._pending[request.request_id] = hashes
            if len(self._pending) > _PENDING_LIMIT:
                self._pending.popitem(last=False)
        for e in endpoints:
            m = e.metrics
            if m.num_gpu_blocks and m.block_size:
                tokens = m.num_gpu_blocks * m.block_size
                self._capacity[e.hostport] = max(1, tokens * CHARS_PER_TOKEN // self._block_chars)
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
            scores[self._placement.pick(hashes[0], hostports)] = 1.0
        return scores

    def on_routed(self, event: Routed) -> None:
        hashes = self._pending.pop(event.request.request_id, None)
        if hashes is None:
            hashes = self.hashes(event.request)
        if hashes:
            capacity = self._capacity.get(event.endpoint, self._fallback)
            self._index.insert(event.endpoint, hashes, capacity)

    def on_finished(self, event: Finished) -> None:
        self._pending.pop(event.request_id, None)

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        self._index.purge(hostports)
        for gone in [e for e in self._capacity if e not in hostports]:
            del self._capacity[gone]
