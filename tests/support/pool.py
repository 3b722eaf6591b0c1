"""Tiny builders of pool-file YAML documents."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import yaml

V1ALPHA2 = "inference.networking.x-k8s.io/v1alpha2"
V1 = "inference.networking.k8s.io/v1"


def pool(
    name: str = "pool",
    *,
    api: str = V1ALPHA2,
    port: int = 8000,
    ports: Iterable[int] | None = None,
    selector: Mapping[str, str] | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    labels = dict(selector or {"app": "vllm"})
    meta = {"name": name, "namespace": namespace}
    if api == V1ALPHA2:
        spec: dict[str, Any] = {"selector": labels, "targetPortNumber": port}
    else:
        spec = {
            "selector": {"matchLabels": labels},
            "targetPorts": [{"number": p} for p in (ports or [port])],
        }
    return {"apiVersion": api, "kind": "InferencePool", "metadata": meta, "spec": spec}


def model(
    model_name: str,
    *,
    name: str | None = None,
    criticality: str | None = None,
    targets: Mapping[str, int] | None = None,
    pool_ref: str = "pool",
    namespace: str = "default",
    created: str | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name or model_name.replace("/", "-"), "namespace": namespace}
    if created:
        meta["creationTimestamp"] = created
    spec: dict[str, Any] = {"modelName": model_name, "poolRef": {"name": pool_ref}}
    if criticality:
        spec["criticality"] = criticality
    if targets is not None:
        spec["targetModels"] = [{"name": n, "weight": w} for n, w in targets.items()]
    return {"apiVersion": V1ALPHA2, "kind": "InferenceModel", "metadata": meta, "spec": spec}


def objective(
    name: str,
    *,
    priority: int | None = None,
    pool_ref: str = "pool",
    namespace: str = "default",
) -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": pool_ref}}
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": V1ALPHA2,
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def pod(
    name: str,
    ip: str,
    *,
    ready: bool = True,
    labels: Mapping[str, str] | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels or {"app": "vllm"}),
        },
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pool_yaml(*docs: Mapping[str, Any]) -> str:
    return yaml.safe_dump_all(list(docs), sort_keys=False)


# The smallest pool that routes: model "m", served by one Ready pod ("a", 127.0.0.2:8000).
ONE_POD = pool_yaml(pool(), model("m"), pod("a", "127.0.0.2"))
