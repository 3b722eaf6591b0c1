"""``candidate-sampler``: score a sample of a large pool, not all of it.

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
from collections.abc import Iterable, Sequence

from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.framework import CandidateHints
from endpoint_picker.scheduling.placement import PlacementRing
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.types import EndpointState


class CandidateSampler:
    """Past ``threshold`` candidates: ``size`` random ones plus those the scorers prefer."""

    __slots__ = ("_hinters", "_positions", "_ring", "_rng", "_size", "_threshold")

    def __init__(self, threshold: int, size: int, rng: random.Random) -> None:
        self._threshold = threshold
        self._size = size
        self._rng = rng
        self._ring = PlacementRing()
        self._hinters: list[CandidateHints] = []
        # hostport -> its index among the candidates last indexed. Candidates keep the pool's
        # order from one request to the next, so the map rarely needs rebuilding.
        self._positions: dict[str, int] = {}

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
        """Ask ``hinters`` (the scorers of a profile listing this filter) for their endpoints."""
        for hinter in hinters:
            if all(hinter is not known for known in self._hinters):
                self._hinters.append(hinter)

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        self._ring.update(hostports)

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        count = len(endpoints)
        if count <= self._threshold:
            return endpoints
        if not len(self._ring):  # not told the pool (a scheduler used on its own): these
            self._ring.update(frozenset(e.hostport for e in endpoints))
        chosen = set(self._rng.sample(range(count), min(self._size, count)))
        positions = self._positions
        rebuilt = False
        for hinter in self._hinters:
            for hostport in hinter.preferred(request, self._ring):
                i = positions.get(hostport)
                if i is None or i >= count or endpoints[i].hostport != hostport:
                    if rebuilt:  # indexed for these candidates already: not one of them
                        continue
                    positions = self._positions = {e.hostport: j for j, e in enumerate(endpoints)}
                    rebuilt = True
                    i = positions.get(hostport)
                    if i is None:
                        continue
                chosen.add(i)
        return [endpoints[i] for i in sorted(chosen)]
