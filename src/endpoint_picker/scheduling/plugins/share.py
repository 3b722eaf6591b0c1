"""A guard against hot spots that follows what each endpoint was given lately, not its queue now.

``bounded-load-filter`` bounds each endpoint's load at the moment of the pick. Under even
traffic at overload every queue is long and moves by a few requests from one pick to the
next, so that bound keeps sending requests away from their prefix's holder; each of those
pays a full prefill on a saturated pool, and the misses make the TTFT tail (docs/results/
2026-11-27-predicted-latency.md: 634-776 ms at p90 with it, 325-546 without, the SGLang router
311-323). What the guard is for is different: a hot prefix that keeps one endpoint busier than
the others for as long as it stays hot. That shows in the share of requests each endpoint was
routed lately, which even traffic leaves even however the queues move.

``bounded-share-filter`` removes an endpoint whose share of the requests routed lately (counts
decayed by ``1 / window`` per request) is past ``1 + slack`` times the candidates' mean share,
unless its load now is at most the candidates' mean load: a faster server that takes more and
drains it is not held back, and a slower one that falls behind is. It never removes every
endpoint (the least-routed one is always under the bound). State: one float per endpoint in the
pool, forgotten when it leaves.
"""

from __future__ import annotations

from collections.abc import Sequence

from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.lifecycle import Finished, InFlight, Routed
from endpoint_picker.scheduling.placement import RecentShares
from endpoint_picker.scheduling.plugins.affinity import endpoint_loads
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.types import EndpointState


class BoundedShareFilter:
    """Keeps the endpoints within ``1 + slack`` of the mean share of recently routed requests,
    and those whose load now is at most the mean (see the module's docstring)."""

    __slots__ = ("_inflight", "_shares")

    def __init__(self, slack: float, window: int, inflight: InFlight) -> None:
        self._shares = RecentShares(slack=slack, decay=1.0 / window)
        self._inflight = inflight

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> BoundedShareFilter:
        return cls(
            slack=params.number("slack", 0.15, minimum=0.0),
            window=params.integer("window", 512, minimum=1),
            inflight=ctx.inflight,
        )

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        eligible = self._shares.eligible([e.endpoint.hostport for e in endpoints])
        if len(eligible) == len(endpoints):
            return endpoints
        loads = endpoint_loads(endpoints, self._inflight)
        mean = sum(loads) / len(loads)
        within = set(eligible)
        return [e for i, e in enumerate(endpoints) if i in within or loads[i] <= mean]

    def on_routed(self, event: Routed) -> None:
        self._shares.add(event.endpoint)

    def on_finished(self, event: Finished) -> None:
        """Nothing to do: a share counts requests routed, however they end."""

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        self._shares.purge(hostports)
