"""The Kubernetes objects the EPP reads, decoded into frozen dataclasses.

Both sources (the pool file and the Kubernetes watch) produce these same objects, so the
datastore cannot tell where they came from.
"""

from __future__ import annotations

from dataclasses import dataclass

from endpoint_picker.types import Criticality

API_V1ALPHA2 = "inference.networking.x-k8s.io/v1alpha2"
API_V1 = "inference.networking.k8s.io/v1"


@dataclass(frozen=True, slots=True)
class InferencePool:
    name: str
    namespace: str
    api_version: str
    selector: tuple[tuple[str, str], ...]  # matchLabels; every pair must match
    target_ports: tuple[int, ...]
    annotations: tuple[tuple[str, str], ...] = ()  # metadata.annotations, sorted

    def annotation(self, key: str) -> str | None:
        return dict(self.annotations).get(key)

    @property
    def passes_unknown_models(self) -> bool:
        """The default for models no InferenceModel names: v1 pools pass them, v1alpha2 reject."""
        return self.api_version == API_V1


@dataclass(frozen=True, slots=True)
class Objective:
    """The seed's latency objective: the P95, over the requests of a recent time window, of each
    request's average latency per output token (end-to-end latency / output tokens; unlike TPOT
    it includes queueing and prefill). In the YAML:
    ``objective: {desiredAveragePerOutputTokenLatencyAtP95OverMultipleRequests: 50ms}``."""

    per_output_token_p95: float  # seconds, > 0


@dataclass(frozen=True, slots=True)
class TargetModel:
    name: str
    weight: int


@dataclass(frozen=True, slots=True)
class InferenceModel:
    name: str
    namespace: str
    model_name: str
    criticality: Criticality
    target_models: tuple[TargetModel, ...]
    pool_ref: str
    creation_timestamp: float | None  # POSIX seconds; None when absent
    order: int  # position in the source, the tie-breaker when timestamps are absent or equal
    # an objective without a criticality makes the model Critical (the seed's rule)
    objective: Objective | None = None


@dataclass(frozen=True, slots=True)
class InferenceObjective:
    """A request class of a pool (``x-k8s.io/v1alpha2``), named by the request header
    ``x-gateway-inference-objective``; its ``priority`` stands in for InferenceModel criticality
    (negative: sheddable)."""

    name: str
    namespace: str
    priority: int  # unset is 0, or 1 when an objective is set (the seed's rule)
    pool_ref: str
    objective: Objective | None = None


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    namespace: str
    labels: tuple[tuple[str, str], ...]
    pod_ip: str  # "" when not yet assigned
    ready: bool


@dataclass(frozen=True, slots=True)
class ClusterState:
    """Every object a source knows, as of one moment."""

    pools: tuple[InferencePool, ...] = ()
    models: tuple[InferenceModel, ...] = ()
    pods: tuple[Pod, ...] = ()
    objectives: tuple[InferenceObjective, ...] = ()
