"""The live pool: the resolved pool state plus each endpoint's latest metrics snapshot.

Sources call ``apply`` with everything they know; scrapers call ``update_metrics``. Readers get
immutable views, so a scheduling cycle sees every endpoint's metrics as of one moment.

An endpoint is *unreachable* from the moment a scrape is refused or reset, or Envoy reports that
it could not connect to it, until a scrape succeeds again: it leaves the view the scheduler
reads, so a dead pod stops getting traffic at once instead of when its last metrics go stale.
When every endpoint is unreachable the view keeps them all: the EPP then routes as it would
without the signal, rather than refusing traffic on what may be a metrics-only fault.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from endpoint_picker.datastore.objects import (
    ClusterState,
    InferenceModel,
    InferenceObjective,
    InferencePool,
)
from endpoint_picker.datastore.pool import PoolState, resolve_pool
from endpoint_picker.types import EMPTY_METRICS, Endpoint, EndpointState, MetricsSnapshot

log = structlog.get_logger(__name__)

_MAX_LOGGED_DUPLICATES = 10  # a pool of a thousand pods on one address logs ten lines of it

EndpointsListener = Callable[[tuple[Endpoint, ...]], None]


class Datastore:
    def __init__(self, pool_name: str | None = None) -> None:
        self._pool_name = pool_name
        self._state: PoolState | None = None
        self._metrics: dict[str, MetricsSnapshot] = {}
        # Every endpoint with its metrics, in pool order, and each hostport's position in it:
        # a scrape replaces one element (a pool of a thousand endpoints is scraped thousands
        # of times a second), and the view handed to each pick is a copy of this list.
        self._positions: dict[str, int] = {}
        self._states: list[EndpointState] | None = None
        self._view: tuple[EndpointState, ...] | None = None
        self._unreachable: dict[str, str] = {}  # hostport -> why
        self._listeners: list[EndpointsListener] = []

    # -- writers -------------------------------------------------------------------------------

    def apply(self, cluster: ClusterState) -> PoolState:
        """Swap in a new pool state; raises ``ConfigError`` and keeps the old one when invalid."""
        return self.install(resolve_pool(cluster, self._pool_name))

    def install(self, new: PoolState) -> PoolState:
        """Swap in an already resolved pool state (a worker process gets its parent's)."""
        old_endpoints = self._state.endpoints if self._state else ()
        old_duplicates = self._state.duplicates if self._state else ()
        self._state = new
        live = self._positions = {e.hostport: i for i, e in enumerate(new.endpoints)}
        self._metrics = {k: v for k, v in self._metrics.items() if k in live}
        self._unreachable = {k: v for k, v in self._unreachable.items() if k in live}
        self._states = self._view = None
        if new.endpoints != old_endpoints:
            log.info(
                "pool endpoints changed",
                pool=new.pool.name,
                endpoints=[e.hostport for e in new.endpoints],
            )
            for listener in self._listeners:
                listener(new.endpoints)
        if new.duplicates and new.duplicates != old_duplicates:
            # once per change of the set, not on every pod event of a Kubernetes watch
            log.warning(
                "pods share an address; routing to each address once",
                pool=new.pool.name,
                duplicates=[d.describe() for d in new.duplicates[:_MAX_LOGGED_DUPLICATES]],
                count=len(new.duplicates),
            )
        return new

    def resolve(self, cluster: ClusterState) -> PoolState:
        """What ``apply`` would swap in, without swapping: lets a source vet a change first."""
        return resolve_pool(cluster, self._pool_name)

    def update_metrics(self, endpoint: Endpoint, snapshot: MetricsSnapshot) -> None:
        """Swap in an endpoint's metrics; late updates for removed endpoints are dropped."""
        hostport = endpoint.hostport
        position = self._positions.get(hostport)
        if position is None:
            return
        self._metrics[hostport] = snapshot
        if self._states is not None:
            self._states[position] = EndpointState(self._states[position].endpoint, snapshot)
        if self._unreachable.pop(hostport, None) is not None:
            log.info("endpoint reachable again", endpoint=hostport)
        self._view = None

    def mark_unreachable(self, hostport: str, reason: str) -> None:
        """Keep ``hostport`` out of the view until its next successful scrape."""
        if hostport in self._unreachable or hostport not in self._positions:
            return
        self._unreachable[hostport] = reason
        self._view = None
        log.warning("endpoint unreachable, not routing to it", endpoint=hostport, reason=reason)

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
    def state(self) -> PoolState | None:
        """The served pool as of now (immutable: pool, models, endpoints), None before a load."""
        return self._state

    def metrics_of(self, hostport: str) -> MetricsSnapshot:
        """An endpoint's latest metrics, reachable or not (``EMPTY_METRICS``: never scraped)."""
        return self._metrics.get(hostport, EMPTY_METRICS)

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._state.endpoints if self._state else ()

    def model(self, model_name: str) -> InferenceModel | None:
        return self._state.models.get(model_name) if self._state else None

    def objective(self, name: str) -> InferenceObjective | None:
        """The pool's InferenceObjective called ``name``, if any."""
        return self._state.objectives.get(name) if self._state else None

    def is_configured_model(self, name: str) -> bool:
        """Whether the pool names ``name``: an InferenceModel or one of its target models."""
        return self._state is not None and name in self._state.configured_names

    def model_names(self) -> tuple[str, ...]:
        """The names of the pool's InferenceModels (what clients ask for)."""
        return tuple(self._state.models) if self._state else ()

    @property
    def unreachable(self) -> dict[str, str]:
        """The endpoints currently kept out of the view, with why (a copy)."""
        return dict(self._unreachable)

    def endpoint_states(self) -> tuple[EndpointState, ...]:
        """Every reachable endpoint with its metrics, as of now (cached until the next change)."""
        view = self._view
        if view is None:
            states = self._states
            if states is None:
                metrics = self._metrics
                states = self._states = [
                    EndpointState(e, metrics.get(e.hostport, EMPTY_METRICS)) for e in self.endpoints
                ]
            unreachable = self._unreachable
            reachable = [s for s in states if s.hostport not in unreachable] if unreachable else []
            view = self._view = tuple(reachable or states)
        return view
