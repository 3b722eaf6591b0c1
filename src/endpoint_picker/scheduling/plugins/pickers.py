"""Built-in pickers, and the profile handler that picks among the profiles' results.

Each picker returns up to N distinct endpoints, best (or first drawn) first.

N is ``maxNumOfEndpoints`` when given, else 1 + ``SchedulingSettings.max_fallback_endpoints``:
the primary endpoint and the fallbacks the proxy may retry on.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence
from typing import Self

from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.registry import NoParams, Params, PluginContext
from endpoint_picker.types import EndpointState


class _Picker:
    """What every built-in picker holds: N and the random source it draws or breaks ties with."""

    __slots__ = ("_k", "_rng")

    def __init__(self, max_endpoints: int, rng: random.Random) -> None:
        self._k = max_endpoints
        self._rng = rng

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> Self:
        return cls(params.integer("maxNumOfEndpoints", ctx.max_endpoints, minimum=1), ctx.rng)


class RandomPicker(_Picker):
    """Ignores scores: N endpoints uniformly at random."""

    __slots__ = ()

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], scores: Sequence[float]
    ) -> Sequence[EndpointState]:
        return self._rng.sample(endpoints, min(self._k, len(endpoints)))


class MaxScorePicker(_Picker):
    """The N highest scores, best first; equal scores are ordered at random.

    Random tie-breaking matters: with equal metrics (an idle pool, or between scrapes) a fixed
    order would send every request to the same endpoint.
    """

    __slots__ = ()

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], scores: Sequence[float]
    ) -> Sequence[EndpointState]:
        if self._k == 1:
            # The common case, without a sort: one pass for the best, one for its ties.
            best = max(scores)
            tied = [i for i, s in enumerate(scores) if s == best]
            i = tied[0] if len(tied) == 1 else tied[int(self._rng.random() * len(tied))]
            return (endpoints[i],)
        rand = self._rng.random
        keyed = [(s, rand(), i) for i, s in enumerate(scores)]
        return tuple(endpoints[i] for _, _, i in heapq.nlargest(self._k, keyed))


class WeightedRandomPicker(_Picker):
    """Draws N endpoints without replacement, each with probability proportional to its score.

    Spreads load more than max-score while still favouring good endpoints; when every
    remaining score is zero the draw is uniform.
    """

    __slots__ = ()

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], scores: Sequence[float]
    ) -> Sequence[EndpointState]:
        rand = self._rng.random
        weights = [s if s > 0.0 else 0.0 for s in scores]
        remaining = list(range(len(endpoints)))
        picked: list[EndpointState] = []
        for _ in range(min(self._k, len(endpoints))):
            total = sum(weights[i] for i in remaining)
            pos = len(remaining) - 1
            if total > 0.0:
                target = rand() * total
                for j, i in enumerate(remaining):
                    target -= weights[i]
                    if target < 0.0 and weights[i] > 0.0:
                        pos = j
                        break
                else:
                    # Rounding left target >= 0: take the last positive weight.
                    pos = max(j for j, i in enumerate(remaining) if weights[i] > 0.0)
            else:
                pos = int(rand() * len(remaining))
            picked.append(endpoints[remaining.pop(pos)])
        return picked


# -- profile handlers: which profiles run for a request, and whose result answers it ------------


class SingleProfileHandler(NoParams):
    """Runs the only profile once; its result is the answer (the build checks there is one)."""

    __slots__ = ()

    def pick_profiles(
        self,
        request: LLMRequest,
        profiles: Sequence[str],
        results: Mapping[str, Sequence[EndpointState]],
    ) -> Sequence[str]:
        return () if results else profiles[:1]

    def primary(self, request: LLMRequest, results: Mapping[str, Sequence[EndpointState]]) -> str:
        return next(iter(results))
