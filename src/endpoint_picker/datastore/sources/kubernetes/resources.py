"""The Kubernetes kinds the source watches, and their conversion into our frozen objects.

Every object goes through the same decoder as the pool file (``decode_documents``), so the
datastore gets identical values from either source. An object the decoder refuses is logged
and left out; the API server's CRD validation makes that rare.
"""

from __future__ import annotations

from typing import Any, TypeVar

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


_Decoded = TypeVar("_Decoded", InferencePool, InferenceModel, InferenceObjective, Pod)


def _decode_doc(doc: dict[str, Any], cls: type[_Decoded]) -> _Decoded:
    """One document through the pool file's decoder; ``ConfigError`` names the field at fault."""
    meta = doc.get("metadata") or {}
    source = f"kubernetes {doc.get('kind')} {meta.get('namespace')}/{meta.get('name')}"
    state = decode_documents([doc], source)
    decoded = (state.pools or state.models or state.pods or state.objectives)[0]
    assert isinstance(decoded, cls)
    return decoded


def _decode_as(
    obj: GenericNamespacedResource, api_version: str, kind: str, cls: type[_Decoded]
) -> _Decoded:
    doc: dict[str, Any] = obj.to_dict()  # type: ignore[no-untyped-call]  # lightkube: untyped
    doc.setdefault("apiVersion", api_version)
    doc.setdefault("kind", kind)
    return _decode_doc(doc, cls)


def decode_pool(obj: GenericNamespacedResource, api_version: str) -> InferencePool:
    return _decode_as(obj, api_version, "InferencePool", InferencePool)


def decode_model(obj: GenericNamespacedResource) -> InferenceModel:
    """An InferenceModel (``order`` is fixed later, when the source builds its state)."""
    return _decode_as(obj, API_V1ALPHA2, "InferenceModel", InferenceModel)


def decode_objective(obj: GenericNamespacedResource) -> InferenceObjective:
    return _decode_as(obj, API_V1ALPHA2, "InferenceObjective", InferenceObjective)


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
    return _decode_doc(doc, Pod)
