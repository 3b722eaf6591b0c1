"""Built-in scorers: each returns one score in [0, 1] per endpoint, higher is better."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from endpoint_picker.errors import kept
from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.lifecycle import Finished, Routed, remember
from endpoint_picker.scheduling.placement import RingWalk
from endpoint_picker.scheduling.registry import NoParams
from endpoint_picker.types import EndpointState, is_base_model

_RECENT_ENDPOINTS = 8  # per adapter, where its requests went lately
_ADAPTERS_LIMIT = 10_000  # adapters whose recent endpoints are remembered


def _min_max_inverted(values: Sequence[float]) -> list[float]:
    """Lowest value -> 1.0, highest -> 0.0, linear between; all equal -> 1.0 for all."""
    low = min(values)
    spread = max(values) - low
    if spread == 0:
        return [1.0] * len(values)
    return [1.0 - (v - low) / spread for v in values]


class QueueScorer(NoParams):
    """Prefers short waiting queues: the min-max normalised queue size, inverted."""

    __slots__ = ()

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        return _min_max_inverted([e.metrics.waiting_queue_size for e in endpoints])


class RunningRequestsSizeScorer(NoParams):
    """Prefers endpoints running fewer requests: min-max normalised, inverted."""

    __slots__ = ()

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        return _min_max_inverted([e.metrics.running_requests for e in endpoints])


class KVCacheUtilizationScorer(NoParams):
    """Prefers free KV cache: ``1 - usage`` (the runner clamps usage reported above 1)."""

    __slots__ = ()

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        return [1.0 - e.metrics.kv_cache_usage for e in endpoints]


class LoraAffinityScorer(NoParams):
    """Prefers endpoints where the request's adapter (``target_model``) is cheap to serve.

    In this precedence: the adapter is running (1.0); else a free adapter slot, counting
    adapters both running and waiting to load (0.8); else no LoRA info reported yet (0.7);
    else the adapter is waiting to load (0.6); else 0. A free slot ranks above "waiting"
    because a waiting adapter sits behind a full set of running ones. An endpoint without
    LoRA info has no adapter loaded and probably free slots (a fresh pod), but that is a guess,
    so it ranks just below a known free slot.

    A base-model request (its target model is some candidate's base model and no candidate's
    adapter) has nothing to load: every endpoint scores 1.0, so LoRA state never steers it.

    For a sampled pool (``candidate-sampler``) it names the last ``_RECENT_ENDPOINTS``
    endpoints an adapter's requests were routed to: they have it loaded, or had it lately.
    """

    __slots__ = ("_free_slot", "_recent", "_running", "_scored", "_unknown", "_waiting")

    def __init__(
        self,
        running: float = 1.0,
        free_slot: float = 0.8,
        unknown: float = 0.7,
        waiting: float = 0.6,
    ) -> None:
        self._running = running
        self._free_slot = free_slot
        self._unknown = unknown
        self._waiting = waiting
        # adapter -> the endpoints its requests went to lately (oldest first), and the
        # adapter requests scored but not yet routed
        self._recent: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        self._scored: OrderedDict[str, str] = OrderedDict()

    def preferred(self, request: LLMRequest, ring: RingWalk) -> Iterable[str]:
        recent = self._recent.get(kept(request.target_model))
        return tuple(recent) if recent else ()

    def on_routed(self, event: Routed) -> None:
        adapter = self._scored.pop(event.request.request_id, None) if self._scored else None
        if adapter is None:
            return
        recent = self._recent.get(adapter)
        if recent is None:
            recent = self._recent[adapter] = OrderedDict()
            if len(self._recent) > _ADAPTERS_LIMIT:
                self._recent.popitem(last=False)
        recent[event.endpoint] = None
        recent.move_to_end(event.endpoint)
        if len(recent) > _RECENT_ENDPOINTS:
            recent.popitem(last=False)

    def on_finished(self, event: Finished) -> None:
        if self._scored:
            self._scored.pop(event.request_id, None)

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        for recent in self._recent.values():
            for gone in [h for h in recent if h not in hostports]:
                del recent[gone]

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> Sequence[float]:
        adapter = request.target_model
        if is_base_model(adapter, endpoints):
            return [self._running] * len(endpoints)
        # where it goes: ``preferred``; the name as kept (a client's, for unknown models)
        remember(self._scored, request.request_id, kept(adapter))
        running, free_slot, unknown, waiting = (
            self._running,
            self._free_slot,
            self._unknown,
            self._waiting,
        )
        # "for m in (e.metrics,)" is a plain assignment inside a comprehension (CPython >= 3.9).
        return [
            running
            if adapter in m.active_adapters
            else unknown
            if m.max_active_adapters is None
            else free_slot
            if len(m.active_adapters) + len(m.waiting_adapters) < m.max_active_adapters
            else waiting
            if adapter in m.waiting_adapters
            else 0.0
            for e in endpoints
            for m in (e.metrics,)
        ]
