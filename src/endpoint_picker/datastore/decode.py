"""Decode Kubernetes-shaped documents (YAML or JSON, already parsed) into our objects.

Every error names the document and the field at fault, e.g.
``pool.yaml document 3 (InferenceModel "chat"): spec.targetModels[1].weight: must be an integer``.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

from endpoint_picker.datastore.objects import (
    API_V1,
    API_V1ALPHA2,
    ClusterState,
    InferenceModel,
    InferenceObjective,
    InferencePool,
    Objective,
    Pod,
    TargetModel,
)
from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import parse_duration
from endpoint_picker.types import Criticality

# The one field of an objective (the seed's LLMService API), a Go duration such as ``50ms``.
OBJECTIVE_P95_KEY = "desiredAveragePerOutputTokenLatencyAtP95OverMultipleRequests"

_KNOWN_KINDS = {
    ("InferencePool", API_V1ALPHA2),
    ("InferencePool", API_V1),
    ("InferenceModel", API_V1ALPHA2),
    ("InferenceObjective", API_V1ALPHA2),
    ("Pod", "v1"),
}


class _Fields:
    """Typed accessors over one document that raise ``ConfigError`` with the field path."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, message: str) -> ConfigError:
        return ConfigError(message, f"{self.where}: {path}" if path else self.where)

    def mapping(self, value: Any, path: str, required: bool = True) -> Mapping[str, Any]:
        if value is None and not required:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(path, "must be a mapping" if value is not None else "is required")
        return value

    def string(self, value: Any, path: str, required: bool = True) -> str:
        if value is None and not required:
            return ""
        if not isinstance(value, str) or (required and not value):
            raise self.fail(path, "must be a non-empty string" if required else "must be a string")
        return value

    def namespace(self, meta: Mapping[str, Any]) -> str:
        """``metadata.namespace``, "default" when absent (as Kubernetes fills it in)."""
        return self.string(meta.get("namespace"), "metadata.namespace", required=False) or "default"

    def pool_ref(self, spec: Mapping[str, Any]) -> str:
        """The name of the pool ``spec.poolRef`` points at."""
        return self.string(
            self.mapping(spec.get("poolRef"), "spec.poolRef").get("name"), "spec.poolRef.name"
        )

    def port(self, value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            raise self.fail(path, "must be a port number between 1 and 65535")
        return value

    def labels(self, value: Any, path: str, what: str = "label") -> tuple[tuple[str, str], ...]:
        items = self.mapping(value, path, required=False)
        pairs = []
        for key, val in items.items():
            if not isinstance(key, str) or not isinstance(val, str | int | float | bool):
                raise self.fail(f"{path}.{key}", f"{what} values must be strings")
            pairs.append((key, val if isinstance(val, str) else str(val).lower()))
        return tuple(sorted(pairs))


def _decode_pool(doc: Mapping[str, Any], api: str, f: _Fields) -> InferencePool:
    meta = f.mapping(doc.get("metadata"), "metadata")
    spec = f.mapping(doc.get("spec"), "spec")
    if api == API_V1ALPHA2:
        selector = f.labels(spec.get("selector"), "spec.selector")
        ports: tuple[int, ...] = (f.port(spec.get("targetPortNumber"), "spec.targetPortNumber"),)
    else:
        sel = f.mapping(spec.get("selector"), "spec.selector")
        selector = f.labels(sel.get("matchLabels"), "spec.selector.matchLabels")
        raw_ports = spec.get("targetPorts")
        if not isinstance(raw_ports, list) or not raw_ports:
            raise f.fail("spec.targetPorts", "must be a non-empty list of {number: port}")
        ports = tuple(
            f.port(
                f.mapping(p, f"spec.targetPorts[{i}]").get("number"),
                f"spec.targetPorts[{i}].number",
            )
            for i, p in enumerate(raw_ports)
        )
        if len(set(ports)) != len(ports):
            raise f.fail("spec.targetPorts", "ports must be distinct")
    if not selector:
        raise f.fail("spec.selector", "must select at least one label")
    return InferencePool(
        name=f.string(meta.get("name"), "metadata.name"),
        namespace=f.namespace(meta),
        api_version=api,
        selector=selector,
        target_ports=ports,
        annotations=f.labels(meta.get("annotations"), "metadata.annotations", "annotation"),
    )


def _timestamp(value: Any, f: _Fields) -> float | None:
    """``metadata.creationTimestamp`` as POSIX seconds; naive times are UTC (as Kubernetes')."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = datetime.datetime.fromisoformat(value)
        except ValueError:
            raise f.fail("metadata.creationTimestamp", f"not an RFC 3339 time: {value!r}") from None
    if not isinstance(value, datetime.datetime):  # YAML parses unquoted times itself
        raise f.fail("metadata.creationTimestamp", "must be an RFC 3339 time")
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.UTC)
    return float(value.timestamp())


def _decode_latency_objective(spec: Mapping[str, Any], f: _Fields) -> Objective | None:
    """``spec.objective``, or None when absent: a positive Go duration (``50ms``), no other key."""
    raw = spec.get("objective")
    if raw is None:
        return None
    entry = f.mapping(raw, "spec.objective")
    for key in entry:
        if key != OBJECTIVE_P95_KEY:
            raise f.fail(f"spec.objective.{key}", f"unknown field (known: {OBJECTIVE_P95_KEY})")
    path = f"spec.objective.{OBJECTIVE_P95_KEY}"
    value = entry.get(OBJECTIVE_P95_KEY)
    if not isinstance(value, str):
        raise f.fail(path, "is required: a duration such as 50ms")
    try:
        seconds = parse_duration(value)
    except ConfigError as exc:
        raise f.fail(path, str(exc)) from None
    if seconds <= 0:
        raise f.fail(path, f"must be a duration > 0, not {value!r}")
    return Objective(seconds)


def _decode_model(doc: Mapping[str, Any], order: int, f: _Fields) -> InferenceModel:
    meta = f.mapping(doc.get("metadata"), "metadata")
    spec = f.mapping(doc.get("spec"), "spec")
    objective = _decode_latency_objective(spec, f)
    raw_crit = spec.get("criticality")
    if raw_crit is None:
        # the seed: "Priority class is implicitly set to Critical by specifying an Objective"
        criticality = Criticality.CRITICAL if objective else Criticality.STANDARD
    else:
        try:
            criticality = Criticality(raw_crit)
        except ValueError:
            raise f.fail(
                "spec.criticality", f"must be Critical, Standard or Sheddable, not {raw_crit!r}"
            ) from None
    raw_targets = spec.get("targetModels") or []
    if not isinstance(raw_targets, list):
        raise f.fail("spec.targetModels", "must be a list of {name, weight}")
    targets = []
    for i, raw in enumerate(raw_targets):
        entry = f.mapping(raw, f"spec.targetModels[{i}]")
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
            raise f.fail(f"spec.targetModels[{i}].weight", "must be an integer >= 0")
        targets.append(
            TargetModel(f.string(entry.get("name"), f"spec.targetModels[{i}].name"), weight)
        )
    created = meta.get("creationTimestamp")
    return InferenceModel(
        name=f.string(meta.get("name"), "metadata.name"),
        namespace=f.namespace(meta),
        model_name=f.string(spec.get("modelName"), "spec.modelName"),
        criticality=criticality,
        target_models=tuple(targets),
        pool_ref=f.pool_ref(spec),
        creation_timestamp=_timestamp(created, f),
        order=order,
        objective=objective,
    )


def _decode_objective(doc: Mapping[str, Any], f: _Fields) -> InferenceObjective:
    meta = f.mapping(doc.get("metadata"), "metadata")
    spec = f.mapping(doc.get("spec"), "spec")
    objective = _decode_latency_objective(spec, f)
    priority = spec.get("priority")
    if priority is None:  # an objective without a priority is Critical, as on InferenceModel
        priority = 1 if objective else 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise f.fail("spec.priority", "must be an integer (negative: sheddable)")
    return InferenceObjective(
        name=f.string(meta.get("name"), "metadata.name"),
        namespace=f.namespace(meta),
        priority=priority,
        pool_ref=f.pool_ref(spec),
        objective=objective,
    )


def _decode_pod(doc: Mapping[str, Any], f: _Fields) -> Pod:
    meta = f.mapping(doc.get("metadata"), "metadata")
    status = f.mapping(doc.get("status"), "status", required=False)
    pod_ip = f.string(status.get("podIP"), "status.podIP", required=False)
    if pod_ip:
        try:
            pod_ip = str(ipaddress.ip_address(pod_ip))
        except ValueError:
            raise f.fail("status.podIP", f"{pod_ip!r} is not an IP address") from None
    conditions = status.get("conditions") or []
    if not isinstance(conditions, list):
        raise f.fail("status.conditions", "must be a list")
    ready = any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and str(c.get("status")) == "True"
        for c in conditions
    )
    return Pod(
        name=f.string(meta.get("name"), "metadata.name"),
        namespace=f.namespace(meta),
        labels=f.labels(meta.get("labels"), "metadata.labels"),
        pod_ip=pod_ip,
        ready=ready,
    )


def decode_documents(docs: Iterable[Any], source: str) -> ClusterState:
    """Decode a stream of documents; empty documents are skipped, unknown kinds rejected."""
    pools: list[InferencePool] = []
    models: list[InferenceModel] = []
    pods: list[Pod] = []
    objectives: list[InferenceObjective] = []
    for index, doc in enumerate(docs, start=1):
        if doc is None:
            continue
        where = f"{source} document {index}"
        if not isinstance(doc, Mapping):
            raise ConfigError("must be a mapping with apiVersion and kind", where)
        kind, api = doc.get("kind"), doc.get("apiVersion")
        if not isinstance(kind, str) or not isinstance(api, str):
            raise ConfigError("apiVersion and kind must be strings", where)
        name = (
            doc.get("metadata", {}).get("name")
            if isinstance(doc.get("metadata"), Mapping)
            else None
        )
        if name:
            where = f'{where} ({kind} "{name}")'
        f = _Fields(where)
        if (kind, api) not in _KNOWN_KINDS:
            raise f.fail(
                "kind",
                f"unsupported {kind!r} {api!r} (expected InferencePool {API_V1ALPHA2} or {API_V1}, "
                f"InferenceModel or InferenceObjective {API_V1ALPHA2}, Pod v1)",
            )
        if kind == "InferencePool":
            pools.append(_decode_pool(doc, str(api), f))
        elif kind == "InferenceModel":
            models.append(_decode_model(doc, index, f))
        elif kind == "InferenceObjective":
            objectives.append(_decode_objective(doc, f))
        else:
            pods.append(_decode_pod(doc, f))
    return ClusterState(
        pools=tuple(pools), models=tuple(models), pods=tuple(pods), objectives=tuple(objectives)
    )
