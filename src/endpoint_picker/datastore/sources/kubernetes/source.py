"""The Kubernetes source: the InferencePool, its InferenceModels and the namespace's Pods, live.

Four reflectors (list, then watch; see ``reflector.py``) keep what the API server says:

- the ``InferencePool`` named ``--pool-name`` (a field selector on its name),
- every ``InferenceModel`` and ``InferenceObjective`` of the namespace (the datastore keeps
  those whose ``poolRef`` names the pool, as with the pool file; a kind whose CRD is not
  installed counts as empty),
- every ``Pod`` of the namespace. The datastore keeps the Ready ones the pool's selector
  matches; watching the namespace rather than the selector means a selector edit takes effect
  at once, with no new list (the reference EPP's pod cache does the same).

Any change wakes the publisher, which builds the same ``ClusterState`` the pool file gives and
applies it to the datastore (changes that arrive together are applied once). The first apply
happens only after every kind has been listed: that is the first full sync, and only then
is the EPP ready. A deleted (or invalid) InferencePool makes it not ready again; the last pool
stays in the datastore meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx2
import structlog
from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import ConfigError as KubeConfigError
from lightkube.resources.core_v1 import Pod as KubePod

from endpoint_picker.datastore.objects import (
    ClusterState,
    InferenceModel,
    InferenceObjective,
    InferencePool,
    Pod,
)
from endpoint_picker.datastore.sources.file import PoolTarget
from endpoint_picker.datastore.sources.kubernetes.reflector import Reflector
from endpoint_picker.datastore.sources.kubernetes.resources import (
    INFERENCE_MODEL,
    INFERENCE_OBJECTIVE,
    decode_model,
    decode_objective,
    decode_pod,
    decode_pool,
    pool_resource,
)
from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import KubernetesSettings

log = structlog.get_logger(__name__)

ReadinessSink = Callable[[bool], Awaitable[None]]


def _kubeconfig_path() -> Path:
    """The first existing file of ``$KUBECONFIG`` (a path list, as kubectl reads it), else
    ~/.kube/config."""
    for entry in os.environ.get("KUBECONFIG", "").split(os.pathsep):
        if entry and Path(entry).expanduser().is_file():
            return Path(entry).expanduser()
    return Path("~/.kube/config").expanduser()


def load_kube_config(kubeconfig: Path | None) -> KubeConfig:
    """``--kubeconfig``, else in-cluster credentials, else ``$KUBECONFIG`` or ~/.kube/config."""
    try:
        if kubeconfig is not None:
            return KubeConfig.from_file(kubeconfig)
        try:
            return KubeConfig.from_service_account()
        except KubeConfigError:  # not in a cluster
            return KubeConfig.from_file(_kubeconfig_path())
    except (KubeConfigError, OSError, ValueError, KeyError) as exc:
        where = str(kubeconfig) if kubeconfig else "in-cluster, $KUBECONFIG, ~/.kube/config"
        raise ConfigError(f"cannot load Kubernetes credentials: {exc}", where) from exc


def build_client(settings: KubernetesSettings) -> AsyncClient:
    """An async client; ``ConfigError`` when no usable credentials are found."""
    config = load_kube_config(settings.kubeconfig)
    return AsyncClient(
        config,
        namespace=settings.namespace,
        timeout=httpx2.Timeout(settings.request_timeout),
    )


def _ordered(models: dict[str, InferenceModel]) -> tuple[InferenceModel, ...]:
    """Models in a stable order (oldest first, then by name): ``order`` breaks timestamp ties."""
    ranked = sorted(
        models.values(), key=lambda m: (m.creation_timestamp or 0.0, m.namespace, m.name)
    )
    return tuple(dataclasses.replace(m, order=i) for i, m in enumerate(ranked))


class KubernetesSource:
    """Feeds ``target`` from the API server; run ``tasks()`` as named app tasks."""

    def __init__(
        self,
        client: AsyncClient,
        target: PoolTarget,
        pool_name: str,
        settings: KubernetesSettings,
        *,
        readiness: ReadinessSink | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self._client = client
        self._target = target
        self._pool_name = pool_name
        self._namespace = settings.namespace
        self._readiness = readiness
        self._changed = asyncio.Event()
        self.ready = False  # the pool is synced and in force
        self.synced = asyncio.Event()  # set at the first full sync (tests wait on it)
        self.applied = 0  # states applied to the target
        api_version, pool_res = pool_resource(settings.group)
        common: dict[str, Any] = {"settings": settings, "sleep": sleep, "rng": rng}
        self.pools: Reflector[InferencePool] = Reflector(
            "InferencePool",
            client,
            pool_res,
            self._namespace,
            lambda obj: decode_pool(obj, api_version),
            self._changed.set,
            fields={"metadata.name": pool_name},
            **common,
        )
        self.models: Reflector[InferenceModel] = Reflector(
            "InferenceModel",
            client,
            INFERENCE_MODEL,
            self._namespace,
            decode_model,
            self._changed.set,
            **common,
        )
        self.objectives: Reflector[InferenceObjective] = Reflector(
            "InferenceObjective",
            client,
            INFERENCE_OBJECTIVE,
            self._namespace,
            decode_objective,
            self._changed.set,
            **common,
        )
        self.pods: Reflector[Pod] = Reflector(
            "Pod", client, KubePod, self._namespace, decode_pod, self._changed.set, **common
        )

    @property
    def healthy(self) -> bool:
        """Every watch is open (False while one reconnects: the last state serves)."""
        return all(r.connected for r in self._reflectors)

    @property
    def _reflectors(self) -> tuple[Reflector[Any], ...]:
        return (self.pools, self.models, self.objectives, self.pods)

    def tasks(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """The loops the app runs as named tasks: one per watched kind, and the publisher."""
        return [
            ("kubernetes-watch-inferencepool", self.pools.run()),
            ("kubernetes-watch-inferencemodels", self.models.run()),
            ("kubernetes-watch-inferenceobjectives", self.objectives.run()),
            ("kubernetes-watch-pods", self.pods.run()),
            ("kubernetes-publish", self.publish()),
        ]

    async def publish(self) -> None:
        """Apply the latest state whenever something changed."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            try:
                await self.publish_once()
            except Exception:  # one bad state must not end the loop
                log.exception("kubernetes state not applied")

    async def publish_once(self) -> None:
        if not all(r.synced for r in self._reflectors):
            return
        pool = self.pools.objects.get(self._pool_name)
        if pool is None:
            log.error(
                "InferencePool not found; not ready",
                pool=self._pool_name,
                namespace=self._namespace,
            )
            await self._set_ready(False)
            return
        cluster = ClusterState(
            pools=(pool,),
            models=_ordered(self.models.objects),
            pods=tuple(self.pods.objects.values()),
            objectives=tuple(self.objectives.objects.values()),
        )
        try:
            self._target.apply(cluster)
        except ConfigError as exc:
            log.error("kubernetes state refused; keeping the last good pool", error=str(exc))
            return
        self.applied += 1
        if not self.ready:
            log.info(
                "kubernetes sync complete",
                pool=self._pool_name,
                namespace=self._namespace,
                models=len(self.models.objects),
                pods=len(self.pods.objects),
                endpoints=len(self._target.endpoints),
            )
        await self._set_ready(True)
        self.synced.set()

    async def _set_ready(self, ready: bool) -> None:
        changed = ready != self.ready
        self.ready = ready
        if changed and self._readiness is not None:
            await self._readiness(ready)

    async def close(self) -> None:
        await self._client.close()
