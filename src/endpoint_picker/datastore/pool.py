"""Resolve the served pool out of everything a source knows: its models and its endpoints."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from endpoint_picker.datastore.objects import (
    ClusterState,
    InferenceModel,
    InferenceObjective,
    InferencePool,
    Pod,
)
from endpoint_picker.errors import ConfigError
from endpoint_picker.types import Endpoint


@dataclass(frozen=True, slots=True)
class PoolState:
    """The served pool as of one moment: swapped in whole on every change."""

    pool: InferencePool
    models: Mapping[str, InferenceModel]  # by modelName, after conflict resolution
    endpoints: tuple[Endpoint, ...]
    # Every model name the pool configures: InferenceModel names and their target models.
    configured_names: frozenset[str] = frozenset()
    # The pool's InferenceObjectives by name (what x-gateway-inference-objective names).
    objectives: Mapping[str, InferenceObjective] = field(
        default_factory=lambda: MappingProxyType({})
    )


def select_pool(state: ClusterState, pool_name: str | None) -> InferencePool:
    """The pool named ``pool_name``, or the only pool; a clear error otherwise."""
    names = sorted(f"{p.namespace}/{p.name}" for p in state.pools)
    if pool_name is None:
        if len(state.pools) == 1:
            return state.pools[0]
        if not state.pools:
            raise ConfigError("no InferencePool found")
        raise ConfigError(
            f"several InferencePools ({', '.join(names)}): choose one with --pool-name"
        )
    for pool in state.pools:
        if pool.name == pool_name or f"{pool.namespace}/{pool.name}" == pool_name:
            return pool
    raise ConfigError(
        f"InferencePool {pool_name!r} not found (found: {', '.join(names) or 'none'})"
    )


def _matches(pod: Pod, pool: InferencePool) -> bool:
    labels = dict(pod.labels)
    return all(labels.get(key) == value for key, value in pool.selector)


def pool_endpoints(pool: InferencePool, pods: tuple[Pod, ...]) -> tuple[Endpoint, ...]:
    """Every target port of every Ready pod of the pool's namespace matching its selector."""
    endpoints = []
    for pod in pods:
        if pod.namespace != pool.namespace or not pod.ready or not pod.pod_ip:
            continue
        if not _matches(pod, pool):
            continue
        for port in pool.target_ports:
            endpoints.append(Endpoint(pod.name, pod.namespace, pod.pod_ip, port, pod.labels))
    return tuple(sorted(endpoints, key=lambda e: (e.pod_name, e.port)))


def pool_models(
    pool: InferencePool, models: tuple[InferenceModel, ...]
) -> dict[str, InferenceModel]:
    """The pool's InferenceModels by modelName; of two with one name the older wins."""
    chosen: dict[str, InferenceModel] = {}
    ours = [m for m in models if m.pool_ref == pool.name and m.namespace == pool.namespace]

    # The oldest wins; without timestamps (or with equal ones) the source order decides.
    def age(m: InferenceModel) -> tuple[bool, float, int]:
        absent = m.creation_timestamp is None
        return (absent, m.creation_timestamp or 0.0, m.order)

    for model in sorted(ours, key=age):
        chosen.setdefault(model.model_name, model)
    return chosen


def pool_objectives(
    pool: InferencePool, objectives: tuple[InferenceObjective, ...]
) -> dict[str, InferenceObjective]:
    """The InferenceObjectives whose poolRef names the pool, in its namespace, by name."""
    return {
        o.name: o for o in objectives if o.pool_ref == pool.name and o.namespace == pool.namespace
    }


def resolve_pool(state: ClusterState, pool_name: str | None) -> PoolState:
    pool = select_pool(state, pool_name)
    models = pool_models(pool, state.models)
    return PoolState(
        objectives=MappingProxyType(pool_objectives(pool, state.objectives)),
        pool=pool,
        models=MappingProxyType(models),
        endpoints=pool_endpoints(pool, state.pods),
        configured_names=frozenset(
            [*models, *(t.name for m in models.values() for t in m.target_models)]
        ),
    )
