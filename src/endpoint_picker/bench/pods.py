"""The pool files the benchmarks write: an InferencePool, its InferenceModels, Ready Pods."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

API_VERSION = "inference.networking.x-k8s.io/v1alpha2"
NAMESPACE = "default"


def pool_file_text(
    pool: str,
    labels: Mapping[str, str],
    port: int,
    models: Mapping[str, Mapping[str, Any]],
    addresses: Sequence[str],
    pod_prefix: str,
    selector: Mapping[str, str] | None = None,
) -> str:
    """A pool file: InferencePool ``pool`` selecting ``selector`` (default: every label of the
    pods) on ``port``, an InferenceModel per entry of ``models`` (its name, and its spec
    without ``poolRef``), and a Ready Pod per address with ``labels`` (``ready_pods``)."""
    meta = {"namespace": NAMESPACE}
    docs: list[dict[str, Any]] = [
        {"apiVersion": API_VERSION, "kind": "InferencePool", "metadata": {"name": pool, **meta},
         "spec": {"selector": dict(selector or labels), "targetPortNumber": port}},
    ]  # fmt: skip
    docs += [
        {"apiVersion": API_VERSION, "kind": "InferenceModel", "metadata": {"name": name, **meta},
         "spec": {**spec, "poolRef": {"name": pool}}}
        for name, spec in models.items()
    ]  # fmt: skip
    docs += ready_pods(addresses, labels, NAMESPACE, pod_prefix)
    return yaml.safe_dump_all(docs, sort_keys=False)


def ready_pods(
    addresses: Sequence[str], labels: Mapping[str, str], namespace: str, prefix: str
) -> list[dict[str, Any]]:
    """One Ready Pod per address, named ``prefix0``, ``prefix1``, ..., with ``labels``."""
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{prefix}{i}", "labels": dict(labels), "namespace": namespace},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
        }
        for i, ip in enumerate(addresses)
    ]
