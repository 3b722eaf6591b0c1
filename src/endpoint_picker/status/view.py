"""What the status page shows, as one JSON-ready dict (``GET /api/status``; docs/status-page.md
has the shape).

Read on demand from the parts the composition root built: the datastore (pool, models,
endpoints with their metrics snapshots), the in-flight counter, flow control's queues and the
decision log. Nothing here runs on the request path, and no prompt or body can reach it: the
parts it reads never hold one. Every name shown is ``errors.shown`` (control and bidi characters
escaped): pod, model and adapter names come from the cluster and the model servers, not only
from the operator, and must not reorder the page.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol

from endpoint_picker.datastore import InferenceModel, PoolState
from endpoint_picker.datastore.health import OutlierStatus
from endpoint_picker.errors import shown
from endpoint_picker.types import Endpoint, MetricsSnapshot

SCHEMA_VERSION = 1
ENDPOINTS_PER_STEP = 64  # endpoints described between two yields to the event loop (~0.6 ms)
# flow-control priorities reported by band, besides the pool's InferenceObjectives': the
# criticalities' (Critical 1, Standard 0, Sheddable -1)
_CRITICALITY_PRIORITIES = (1, 0, -1)


class PoolReader(Protocol):
    """What the status page reads of the datastore."""

    @property
    def state(self) -> PoolState | None: ...

    @property
    def unreachable(self) -> dict[str, str]: ...

    def metrics_of(self, hostport: str) -> MetricsSnapshot: ...


class InFlightCounts(Protocol):
    @property
    def total(self) -> int: ...

    def count(self, hostport: str) -> int: ...


class RecentDecisions(Protocol):
    """The last decisions, newest first, JSON-ready (``DecisionLog``, or a parent's merge of
    its workers' logs)."""

    def recent(self) -> list[dict[str, Any]]: ...


class QueueSizes(Protocol):
    """Flow control's queues, when the gate is on."""

    @property
    def waiting(self) -> int: ...

    def waiting_in(self, priority: int) -> int: ...


class Outliers(Protocol):
    """Outlier detection's view of an endpoint (``OutlierDetector``)."""

    def status(self, hostport: str) -> OutlierStatus | None: ...


class PredictorRows(Protocol):
    """The latency predictor's view of one endpoint (None: no model for it yet)."""

    def describe(self, hostport: str) -> dict[str, Any] | None: ...


class KVEventsRows(Protocol):
    """The KV-events subscription of one pod (``KVEventsHub``; None: not subscribed)."""

    def describe(self, pod: str) -> dict[str, Any] | None: ...


class Health(Protocol):
    """Readiness (the gRPC health service's truth) and why a ready EPP is degraded, if it is."""

    def ready(self) -> bool: ...

    def note(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class StatusView:
    """Builds the status dict; ``clock`` is the monotonic clock metrics snapshots are dated by."""

    pool: PoolReader
    _: KW_ONLY
    inflight: InFlightCounts
    decisions: RecentDecisions
    health: Health
    staleness_threshold: float
    engine_label: str
    flow: QueueSizes | None = None
    outliers: Outliers | None = None  # None: off, or a workers' parent (each worker judges)
    # the seconds between two scrapes of an endpoint now (the CPU budget may stretch them)
    refresh_interval: Callable[[], float] | None = None
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    predictor: PredictorRows | None = None  # with a predicted-latency plugin
    kv_events: KVEventsRows | None = None  # with a precise-prefix-cache-scorer

    def snapshot(self) -> dict[str, Any]:
        state = self.pool.state
        now = self.clock()
        unreachable = self.pool.unreachable
        endpoints = state.endpoints if state is not None else ()
        described = [self._endpoint(e, now, unreachable.get(e.hostport)) for e in endpoints]
        return self._with_endpoints(state, described)

    async def snapshot_in_steps(self, step: int = ENDPOINTS_PER_STEP) -> dict[str, Any]:
        """``snapshot``, yielding to the event loop after every ``step`` endpoints: describing
        a thousand endpoints takes about 10 ms, which must not hold up the requests that the
        same loop routes. Each endpoint is described as of its own step."""
        state = self.pool.state
        unreachable = self.pool.unreachable
        endpoints = state.endpoints if state is not None else ()
        described: list[dict[str, Any]] = []
        for start in range(0, len(endpoints), step):
            if start:
                await asyncio.sleep(0)
            now = self.clock()
            described += [
                self._endpoint(e, now, unreachable.get(e.hostport))
                for e in endpoints[start : start + step]
            ]
        return self._with_endpoints(state, described)

    def _with_endpoints(
        self, state: PoolState | None, endpoints: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return {
            "version": SCHEMA_VERSION,
            "time": self.wall_clock(),
            "ready": self.health.ready(),
            "note": self.health.note(),
            "pool": _pool(state),
            "models": [_model(m) for m in _models(state)],
            "stalenessThresholdSeconds": self.staleness_threshold,
            "refreshIntervalSeconds": (
                round(self.refresh_interval(), 3) if self.refresh_interval is not None else None
            ),
            "endpoints": endpoints,
            "inFlight": self.inflight.total,
            "flowControl": self._flow_control(state),
            "decisions": self.decisions.recent(),
        }

    def _endpoint(self, endpoint: Endpoint, now: float, unreachable: str | None) -> dict[str, Any]:
        metrics = self.pool.metrics_of(endpoint.hostport)
        age = round(now - metrics.updated_at, 3) if metrics.updated_at > 0 else None
        return {
            "name": shown(endpoint.pod_name),
            "namespace": shown(endpoint.namespace),
            "address": endpoint.hostport,
            "engine": shown(endpoint.label(self.engine_label) or "vllm"),
            "waiting": metrics.waiting_queue_size,
            "running": metrics.running_requests,
            "kvCacheUsage": round(metrics.kv_cache_usage, 4),
            "activeAdapters": sorted(map(shown, metrics.active_adapters)),
            "waitingAdapters": sorted(map(shown, metrics.waiting_adapters)),
            "maxAdapters": metrics.max_active_adapters,
            "metricsAgeSeconds": age,
            "stale": age is None or age > self.staleness_threshold,
            "unreachable": shown(unreachable) if unreachable is not None else None,
            "inFlight": self.inflight.count(endpoint.hostport),
            "outlier": self._outlier(endpoint.hostport),
            "predictor": (
                self.predictor.describe(endpoint.hostport) if self.predictor is not None else None
            ),
            # by pod IP: one publisher per pod, as the hub subscribes
            "kvEvents": (
                self.kv_events.describe(endpoint.address) if self.kv_events is not None else None
            ),
        }

    def _outlier(self, hostport: str) -> dict[str, Any] | None:
        """The endpoint's ejection: state, until when, its failures; None with none on record."""
        status = self.outliers.status(hostport) if self.outliers is not None else None
        if status is None:
            return None
        left = status.seconds_left
        return {
            "state": status.state.value,
            "consecutiveFailures": status.consecutive_failures,
            "ejections": status.ejections,
            "secondsLeft": round(left, 1) if left is not None else None,
            "ejectedUntil": round(self.wall_clock() + left, 3) if left is not None else None,
            "lastFailure": status.last_failure,
            "probeInFlight": status.probe_in_flight,
        }

    def _flow_control(self, state: PoolState | None) -> dict[str, Any] | None:
        flow = self.flow
        if flow is None:
            return None
        priorities = set(_CRITICALITY_PRIORITIES)
        if state is not None:
            priorities.update(o.priority for o in state.objectives.values())
        by_priority = {str(p): flow.waiting_in(p) for p in sorted(priorities, reverse=True)}
        return {
            "waiting": flow.waiting,
            "byPriority": {p: n for p, n in by_priority.items() if n},
        }


def _pool(state: PoolState | None) -> dict[str, Any] | None:
    if state is None:
        return None
    pool = state.pool
    return {
        "name": shown(pool.name),
        "namespace": shown(pool.namespace),
        "apiVersion": pool.api_version,
        "selector": {shown(k): shown(v) for k, v in pool.selector},
        "targetPorts": list(pool.target_ports),
    }


def _models(state: PoolState | None) -> list[InferenceModel]:
    return sorted(state.models.values(), key=lambda m: m.model_name) if state else []


def _model(model: InferenceModel) -> dict[str, Any]:
    total = sum(t.weight for t in model.target_models)
    return {
        "name": shown(model.model_name),
        "criticality": model.criticality.value,
        "targets": [
            {
                "name": shown(t.name),
                "weight": t.weight,
                "percent": round(100 * t.weight / total, 1) if total else 0.0,
            }
            for t in model.target_models
        ],
        "objective": (
            {"perOutputTokenP95Seconds": model.objective.per_output_token_p95}
            if model.objective
            else None
        ),
    }
