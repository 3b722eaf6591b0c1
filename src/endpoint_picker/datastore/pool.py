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
class DuplicateAddress:
    """Ready pods of the pool that share one address (``ip:port``): one serves it, named first.

    Two pods answer on one address when they run with ``hostNetwork`` on one node, when a stale
    pod keeps an IP that was handed out again, or when a pool file repeats a pod: the address is
    one server, so it is one endpoint (one row, one scraper, one share of the traffic, never two
    entries of one fallback list)."""

    hostport: str
    pods: tuple[str, ...]  # namespace/name, sorted; the first is the endpoint's pod

    def describe(self, most: int = 5) -> str:
        """One line: the address, the pod that keeps it, and (the first ``most`` of) the rest."""
        kept, *dropped = self.pods
        rest = ", ".join(dropped[:most]) + (
            f" and {len(dropped) - most} more" if len(dropped) > most else ""
        )
        return f"{self.hostport} is the address of {len(self.pods)} pods: {kept} (kept), {rest}"


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
    # The pods the pool selects, Ready or not: none means the source lost every pod, while
    # pods that are all NotReady are a pool with nothing to serve (503) that knows its pods.
    pod_count: int = 0
    # Addresses that several Ready pods share: each is served once (see DuplicateAddress).
    duplicates: tuple[DuplicateAddress, ...] = ()


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


def pool_pods(pool: InferencePool, pods: tuple[Pod, ...]) -> list[Pod]:
    """The pods the pool selects (its namespace, its selector), Ready or not."""
    return [p for p in pods if p.namespace == pool.namespace and _matches(p, pool)]


def pool_endpoints(
    pool: InferencePool, pods: tuple[Pod, ...]
) -> tuple[tuple[Endpoint, ...], tuple[DuplicateAddress, ...]]:
    """Every target port of every Ready pod of the pool, by pod name and port, each address
    once; and the addresses several pods shared (the first pod by name keeps it)."""
    by_address: dict[str, Endpoint] = {}
    sharers: dict[str, list[str]] = {}
    ready = sorted((p for p in pool_pods(pool, pods) if p.ready and p.pod_ip), key=_pod_key)
    for pod in ready:
        for port in pool.target_ports:
            endpoint = Endpoint(pod.name, pod.namespace, pod.pod_ip, port, pod.labels)
            kept = by_address.setdefault(endpoint.hostport, endpoint)
            if kept is not endpoint:
                sharers.setdefault(endpoint.hostport, [_pod_id(kept)]).append(_pod_id(endpoint))
    endpoints = tuple(sorted(by_address.values(), key=lambda e: (e.pod_name, e.port)))
    duplicates = tuple(DuplicateAddress(h, tuple(names)) for h, names in sorted(sharers.items()))
    return endpoints, duplicates


def _pod_key(pod: Pod) -> tuple[str, str]:
    return (pod.name, pod.namespace)


def _pod_id(endpoint: Endpoint) -> str:
    return f"{endpoint.namespace}/{endpoint.pod_name}"


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
    endpoints, duplicates = pool_endpoints(pool, state.pods)
    return PoolState(
        objectives=MappingProxyType(pool_objectives(pool, state.objectives)),
        pool=pool,
        models=MappingProxyType(models),
        endpoints=endpoints,
        configured_names=frozenset(
            [*models, *(t.name for m in models.values() for t in m.target_models)]
        ),
        pod_count=len(pool_pods(pool, state.pods)),
        duplicates=duplicates,
    )
