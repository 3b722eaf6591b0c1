"""Ready Pod documents for the pool files the benchmarks write."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


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
