"""The Kubernetes kinds the source watches, and their conversion into our frozen objects.

Every object goes through the same decoder as the pool file (``decode_documents``), so the
datastore gets identical values from either source. An object the decoder refuses is logged
and left out; the API server's CRD validation makes that rare.
"""

from __future__ import annotations

from typing import Any

from lightkube.generic_resource import GenericNamespacedResource, create_namespaced_resource
from lightkube.resources.core_v1 import Pod as KubePod

from endpoint_picker.datastore.decode import decode_documents
from endpoint_picker.datastore.objects import (
    API_V1,
    API_V1ALPHA2,
    InferenceModel,
    InferenceObjective,
    InferencePool,
    Pod,
)
from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import GROUP_V1, GROUP_V1ALPHA2

INFERENCE_MODEL = create_namespaced_resource(
    GROUP_V1ALPHA2, "v1alpha2", "InferenceModel", "inferencemodels"
)
INFERENCE_OBJECTIVE = create_namespaced_resource(
    GROUP_V1ALPHA2, "v1alpha2", "InferenceObjective", "inferenceobjectives"
)
_POOLS = {
    GROUP_V1ALPHA2: (
        API_V1ALPHA2,
        create_namespaced_resource(GROUP_V1ALPHA2, "v1alpha2", "InferencePool", "inferencepools"),
    ),
    GROUP_V1: (
        API_V1,
        create_namespaced_resource(GROUP_V1, "v1", "InferencePool", "inferencepools"),
    ),
}


def pool_resource(group: str) -> tuple[str, type[GenericNamespacedResource]]:
    """The apiVersion and lightkube resource of the InferencePool in ``group``."""
    try:
        return _POOLS[group]
    except KeyError:
        raise ConfigError(
            f"unknown InferencePool group {group!r} (expected {GROUP_V1ALPHA2} or {GROUP_V1})"
        ) from None


def _decode_one(doc: dict[str, Any]) -> Any:
    meta = doc.get("metadata") or {}
    source = f"kubernetes {doc.get('kind')} {meta.get('namespace')}/{meta.get('name')}"
    state = decode_documents([doc], source)
    return (state.pools or state.models or state.pods or state.objectives)[0]


def decode_pool(obj: GenericNamespacedResource, api_version: str) -> InferencePool:
    """An InferencePool; ``ConfigError`` names the field at fault."""
    doc: dict[str, Any] = obj.to_dict()  # type: ignore[no-untyped-call]  # lightkube: untyped
    doc.setdefault("apiVersion", api_version)
    doc.setdefault("kind", "InferencePool")
    pool = _decode_one(doc)
    assert isinstance(pool, InferencePool)
    return pool


def decode_model(obj: GenericNamespacedResource) -> InferenceModel:
    """An InferenceModel (``order`` is fixed later, when the source builds its state)."""
    doc: dict[str, Any] = obj.to_dict()  # type: ignore[no-untyped-call]  # lightkube: untyped
    doc.setdefault("apiVersion", API_V1ALPHA2)
    doc.setdefault("kind", "InferenceModel")
    model = _decode_one(doc)
    assert isinstance(model, InferenceModel)
    return model


def decode_objective(obj: GenericNamespacedResource) -> InferenceObjective:
    """An InferenceObjective (v1alpha2): a priority and the pool it belongs to."""
    doc: dict[str, Any] = obj.to_dict()  # type: ignore[no-untyped-call]  # lightkube: untyped
    doc.setdefault("apiVersion", API_V1ALPHA2)
    doc.setdefault("kind", "InferenceObjective")
    objective = _decode_one(doc)
    assert isinstance(objective, InferenceObjective)
    return objective


def decode_pod(obj: KubePod) -> Pod:
    """A Pod, from the few fields the EPP reads. A terminating pod is never Ready: it is
    leaving, and new requests should not be sent to it while it drains."""
    meta = obj.metadata
    status = obj.status
    conditions: list[dict[str, Any]] = []
    terminating = meta is not None and meta.deletionTimestamp is not None
    if status is not None and status.conditions and not terminating:
        conditions = [{"type": c.type, "status": c.status} for c in status.conditions]
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": meta.name if meta else None,
            "namespace": meta.namespace if meta else None,
            "labels": dict(meta.labels or {}) if meta else {},
        },
        "status": {
            "podIP": status.podIP if status else None,
            "conditions": conditions,
        },
    }
    pod = _decode_one(doc)
    assert isinstance(pod, Pod)
    return pod
