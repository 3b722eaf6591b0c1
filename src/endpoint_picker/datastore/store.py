"""The live pool: the resolved pool state plus each endpoint's latest metrics snapshot.

Sources call ``apply`` with everything they know; scrapers call ``update_metrics``. Readers get
immutable views, so a scheduling cycle sees every endpoint's metrics as of one moment.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from endpoint_picker.datastore.objects import ClusterState, InferenceModel, InferencePool
from endpoint_picker.datastore.pool import PoolState, resolve_pool
from endpoint_picker.types import EMPTY_METRICS, Endpoint, EndpointState, MetricsSnapshot

log = structlog.get_logger(__name__)

EndpointsListener = Callable[[tuple[Endpoint, ...]], None]


class Datastore:
    def __init__(self, pool_name: str | None = None) -> None:
        self._pool_name = pool_name
        self._state: PoolState | None = None
        self._metrics: dict[str, MetricsSnapshot] = {}
        self._view: tuple[EndpointState, ...] | None = None
        self._listeners: list[EndpointsListener] = []

    # -- writers -------------------------------------------------------------------------------

    def apply(self, cluster: ClusterState) -> PoolState:
        """Swap in a new pool state; raises ``ConfigError`` and keeps the old one when invalid."""
        new = resolve_pool(cluster, self._pool_name)
        old_endpoints = self._state.endpoints if self._state else ()
        self._state = new
        live = {e.hostport for e in new.endpoints}
        self._metrics = {k: v for k, v in self._metrics.items() if k in live}
        self._view = None
        if new.endpoints != old_endpoints:
            log.info(
                "pool endpoints changed",
                pool=new.pool.name,
                endpoints=[e.hostport for e in new.endpoints],
            )
            for listener in self._listeners:
                listener(new.endpoints)
        return new

    def update_metrics(self, endpoint: Endpoint, snapshot: MetricsSnapshot) -> None:
        """Swap in an endpoint's metrics; late updates for removed endpoints are dropped."""
        if self._state is None or endpoint not in self._state.endpoints:
            return
        self._metrics[endpoint.hostport] = snapshot
        self._view = None

    def on_endpoints_changed(self, listener: EndpointsListener) -> None:
        self._listeners.append(listener)

    # -- readers -------------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self._state is not None

    @property
    def pool(self) -> InferencePool | None:
        return self._state.pool if self._state else None

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._state.endpoints if self._state else ()

    def model(self, model_name: str) -> InferenceModel | None:
        return self._state.models.get(model_name) if self._state else None

    def endpoint_states(self) -> tuple[EndpointState, ...]:
        """Every endpoint with its metrics, as of now (cached until the next change)."""
        view = self._view
        if view is None:
            view = tuple(
                EndpointState(e, self._metrics.get(e.hostport, EMPTY_METRICS))
                for e in self.endpoints
            )
            self._view = view
        return view
