"""An EPP fed by the Kubernetes source with the metrics port's auth on (its default there),
against the API-server double, which reviews the tokens the tests register."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from endpoint_picker.cli import build_parser, settings_from_args
from endpoint_picker.settings import MetricsAuth, Settings
from tests.support.extproc import started_app
from tests.support.kubeapi import FakeKubeApi, serve_kube_api, write_kubeconfig
from tests.support.pool import model, pod, pool

PROMETHEUS = "system:serviceaccount:monitoring:prometheus"
READERS = "metrics-readers"  # a group bound to the metrics-reader ClusterRole
DATA_PATHS = ("/metrics", "/api/status")  # what the metrics-reader ClusterRole allows


def kubernetes_settings(api: FakeKubeApi, tmp_path: Path, *flags: str) -> Settings:
    """What `epp serve --pool-name pool --kubeconfig ... FLAGS` parses to (a flag given in
    FLAGS again overrides the one here)."""
    argv = [
        "serve",
        "--pool-name",
        "pool",
        "--pool-group",  # the fixtures of tests/support/pool.py are v1alpha2
        "inference.networking.x-k8s.io",
        "--kubeconfig",
        str(write_kubeconfig(tmp_path / "kubeconfig", api.url)),
        "--bind-address",
        "127.0.0.1",
        "--grpc-port",
        "0",
        "--grpc-health-port",
        "0",
        "--metrics-port",
        "0",
        "--secure-serving",
        "false",
        "--drain-timeout",
        "0s",
        *flags,
    ]
    return settings_from_args(build_parser().parse_args(argv))


@contextlib.asynccontextmanager
async def kubernetes_epp(
    tmp_path: Path, *flags: str, address: str = "127.0.8.9"
) -> AsyncIterator[tuple[FakeKubeApi, str]]:
    """An EPP watching the double's pool (synced, ready); yields the double and the metrics
    port's base URL."""
    async with serve_kube_api(address) as api:
        api.put(pool(port=8000))
        api.put(model("base"))
        api.put(pod("p0", "127.0.8.2"))
        settings = kubernetes_settings(api, tmp_path, *flags)
        assert settings.server.metrics_endpoint.auth is MetricsAuth.KUBERNETES
        async with started_app(settings, drain_timeout=0) as app:
            assert app.kubernetes is not None
            await asyncio.wait_for(app.kubernetes.synced.wait(), 5)
            yield api, f"http://127.0.0.1:{app.ports.metrics}"
