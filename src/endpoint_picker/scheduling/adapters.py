"""LoRA adapters as the predictor sees them: whether a request names a base model, which
adapters each endpoint holds (its scraped metrics plus what this EPP routed there since), and
what a request's adapter will cost on each endpoint, as features the predictor learns to price."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from endpoint_picker.errors import kept
from endpoint_picker.scheduling.lifecycle import REQUESTS_REMEMBERED
from endpoint_picker.types import EndpointState

NO_ADAPTER = (0.0, 0.0)
_LOAD = (1.0, 0.0)
_LOAD_AFTER_WAIT = (1.0, 1.0)


class AdapterFlights:
    """The adapters of the requests this EPP routed to each endpoint and not yet finished.

    A scrape is up to an interval old: between two, requests for several adapters can be sent
    to one endpoint whose metrics still show free slots, and then wait there for each other.
    What was routed and is still running is loaded there (or about to be), whatever the last
    scrape said. Bounded by the requests remembered (``REQUESTS_REMEMBERED``); adapter names
    are kept cut (``kept``)."""

    __slots__ = ("_by_request", "_counts")

    def __init__(self) -> None:
        self._by_request: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._counts: dict[str, dict[str, int]] = {}

    def routed(self, request_id: str, endpoint: str, adapter: str) -> None:
        self.finished(request_id)  # routed again: it left the first endpoint
        name = kept(adapter)
        self._by_request[request_id] = (endpoint, name)
        held = self._counts.setdefault(endpoint, {})
        held[name] = held.get(name, 0) + 1
        if len(self._by_request) > REQUESTS_REMEMBERED:  # a finish that never came
            self.finished(next(iter(self._by_request)))

    def finished(self, request_id: str) -> None:
        entry = self._by_request.pop(request_id, None)
        if entry is None:
            return
        endpoint, name = entry
        held = self._counts.get(endpoint)
        if held is None or name not in held:
            return
        held[name] -= 1
        if held[name] <= 0:
            del held[name]

    def on(self, endpoint: str) -> frozenset[str]:
        """The adapters of this EPP's unfinished requests on ``endpoint``."""
        held = self._counts.get(endpoint)
        return frozenset(held) if held else frozenset()

    def on_endpoints(self, hostports: frozenset[str]) -> None:
        for gone in [h for h in self._counts if h not in hostports]:
            del self._counts[gone]


def adapter_features(
    model: str | None, endpoints: Sequence[EndpointState], flights: AdapterFlights
) -> list[tuple[float, float]]:
    """Per endpoint, (must load ``model``'s adapter, must first wait for a slot): nothing for a
    base-model request or an adapter running there (scraped, or routed there and unfinished); a
    load where a slot is free (or the server reports no LoRA state: a fresh pod); a load after a
    wait where every slot is taken. The predictor learns what each costs on each endpoint
    (``adapter_load``, ``adapter_wait``). ``model`` None: a base-model request."""
    if model is None:
        return [NO_ADAPTER] * len(endpoints)
    name = kept(model)
    out = []
    for e in endpoints:
        m = e.metrics
        routed = flights.on(e.hostport)
        if model in m.active_adapters or name in routed:
            out.append(NO_ADAPTER)
        elif m.max_active_adapters is None:
            out.append(_LOAD)
        else:
            held = len(m.active_adapters | m.waiting_adapters | routed)
            out.append(_LOAD if held < m.max_active_adapters else _LOAD_AFTER_WAIT)
    return out
