"""Built-in filters: ``stale-metrics-filter`` and ``candidate-sampler``.

``candidate-sampler``: score a sample of a large pool, not all of it.

Every filter and scorer passes over every candidate, so a cycle costs time in proportion to the
pool: about 0.7 ms over 1,024 endpoints in CPython (``benchmarks/bench_scheduling.py``), most of
a core at a few hundred requests a second. Past ``threshold`` candidates this filter keeps
only

- ``size`` endpoints drawn at random: the best of a few random choices balances load almost as
  well as the best of all ("the power of d choices"; Mitzenmacher), and a random sample is an
  unbiased view of the pool's mean load for ``bounded-load-filter``;
- the endpoints the profile's scorers name for this request (``CandidateHints``): the holders
  of the prompt's prefix, the session's endpoint, where the adapter was sent lately, and, for a
  prefix or session nobody holds yet, the first endpoints of its place on a consistent-hash
  ring of the pool, so every replica still starts it on the same endpoint.

Pools of at most ``threshold`` candidates are scored whole, exactly as without this filter.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence

from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.framework import CandidateHints
from endpoint_picker.scheduling.placement import PlacementRing, RingView
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.types import EndpointState


class StaleMetricsFilter:
    """Drops endpoints whose metrics are older than a threshold, unless that would drop them all.

    Scores computed from stale metrics mislead the scorers, but an endpoint we know little
    about still beats no endpoint at all: when nothing fresh is left, everything stays (fail
    open). Never-scraped endpoints (``updated_at == 0``) count as stale.
    """

    __slots__ = ("_clock", "_threshold")

    def __init__(self, threshold: float, clock: Callable[[], float]) -> None:
        self._threshold = threshold
        self._clock = clock

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> StaleMetricsFilter:
        return cls(params.duration("stalenessThreshold", ctx.staleness_threshold), ctx.clock)

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        # Fresh means updated_at >= oldest; updated_at == 0 fails this for any sane clock.
        oldest = max(self._clock() - self._threshold, 1e-9)
        fresh = [e for e in endpoints if e.metrics.updated_at >= oldest]
        return fresh or endpoints


class CandidateSampler:
    """Past ``threshold`` candidates: ``size`` random ones plus those the scorers prefer."""

    __slots__ = ("_hinters", "_positions", "_ring", "_rng", "_size", "_threshold")

    def __init__(self, threshold: int, size: int, rng: random.Random) -> None:
        self._threshold = threshold
        self._size = size
        self._rng = rng
        self._ring = PlacementRing()
        self._hinters: list[CandidateHints] = []
        self._positions = _Positions()

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> CandidateSampler:
        return cls(
            params.integer("threshold", 128, minimum=1),
            params.integer("size", 64, minimum=1),
            ctx.rng,
        )

    @property
    def ring(self) -> PlacementRing:
        return self._ring

    def use_hints(self, hinters: Iterable[CandidateHints]) -> None:
        """Ask ``hinters`` (the scorers of the profile listing this filter) for endpoints."""
        self._hinters = list(hinters)

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        self._ring.update(hostports)
        if len(hostports) > self._threshold:
            self._ring.build()  # now, rather than on the first request that needs it

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        count = len(endpoints)
        if count <= self._threshold:
            return endpoints
        if not len(self._ring):  # not told the pool (a scheduler used on its own): these
            self._ring.update(frozenset(e.hostport for e in endpoints))
        index = _Index(self._positions, endpoints)
        ring = RingView(self._ring, index.has)
        chosen = set(self._rng.sample(range(count), min(self._size, count)))
        for hinter in self._hinters:
            for hostport in hinter.preferred(request, ring):
                i = index.of(hostport)
                if i is not None:
                    chosen.add(i)
        return [endpoints[i] for i in sorted(chosen)]


class _Positions:
    """hostport -> index among the candidates last mapped, and their layout (count, ends)."""

    __slots__ = ("index", "layout")

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.layout: tuple[int, str, str] = (0, "", "")

    def rebuild(self, endpoints: Sequence[EndpointState]) -> None:
        self.index = {e.hostport: j for j, e in enumerate(endpoints)}
        self.layout = _layout(endpoints)


class _Index:
    """Where a hostport sits among one request's candidates, from the sampler's map.

    Candidates keep the pool's order from one request to the next, so the map (built from an
    earlier request's candidates) rarely needs rebuilding: a hit is checked at its index, and
    a miss is believed while the candidates keep the count and the ends the map was built
    from. Otherwise the map is rebuilt, at most once per request."""

    __slots__ = ("_endpoints", "_positions", "_rebuilt")

    def __init__(self, positions: _Positions, endpoints: Sequence[EndpointState]) -> None:
        self._positions = positions
        self._endpoints = endpoints
        self._rebuilt = False

    def of(self, hostport: str) -> int | None:
        endpoints, positions = self._endpoints, self._positions
        i = positions.index.get(hostport)
        if i is not None and i < len(endpoints) and endpoints[i].hostport == hostport:
            return i
        if self._rebuilt or (i is None and positions.layout == _layout(endpoints)):
            return None
        positions.rebuild(endpoints)
        self._rebuilt = True
        return positions.index.get(hostport)

    def has(self, hostport: str) -> bool:
        return self.of(hostport) is not None


def _layout(endpoints: Sequence[EndpointState]) -> tuple[int, str, str]:
    return len(endpoints), endpoints[0].hostport, endpoints[-1].hostport
