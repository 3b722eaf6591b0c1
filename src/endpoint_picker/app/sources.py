"""The pool's two sources as the root runs them: the pool file, or a Kubernetes watch (with
the Lease for HA, and the client the metrics port checks tokens with). Each says when the
EPP is ready and why a ready EPP serves an older state."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.sources.file import PoolFileSource
from endpoint_picker.errors import ConfigError
from endpoint_picker.extproc.server import HealthState
from endpoint_picker.settings import Settings
from endpoint_picker.telemetry.metrics import EppMetrics
from endpoint_picker.telemetry.tasks import NamedTask

if TYPE_CHECKING:  # imported when used: only a Kubernetes deployment loads the client
    from endpoint_picker.datastore.sources.kubernetes import (
        KubernetesAccessReviewer,
        KubernetesSource,
        LeaderElector,
    )


class Source(Protocol):
    """What feeds the datastore its pool and endpoints."""

    @property
    def kubernetes(self) -> KubernetesSource | None: ...

    @property
    def elector(self) -> LeaderElector | None: ...

    @property
    def reviewer(self) -> KubernetesAccessReviewer | None: ...

    def load(self) -> None:
        """Read what is there before anything serves; ``ConfigError`` if it is invalid."""

    def tasks(self) -> list[NamedTask]: ...

    async def serving(self) -> None:
        """Its loops run: say readiness, where this source knows it now."""

    def note(self) -> str | None: ...

    async def release(self) -> None:
        """The drain begins: give up what another replica could take over."""

    async def close(self) -> None: ...


def build_source(
    settings: Settings,
    datastore: Datastore,
    metrics: EppMetrics,
    health: HealthState,
    draining: Callable[[], bool],
) -> Source:
    """The source ``settings`` ask for; ``ConfigError`` when they ask for none."""
    if settings.pool.pool_file is not None:
        return FileFeed(settings, datastore, metrics, health)
    if settings.pool.pool_name:
        return KubernetesFeed(settings, settings.pool.pool_name, datastore, health, draining)
    raise ConfigError("give --pool-file PATH, or --pool-name NAME to watch Kubernetes")


class FileFeed:
    """The pool file: loaded at start, reloaded when it changes; ready once it loads."""

    kubernetes = None
    elector = None
    reviewer = None

    def __init__(
        self, settings: Settings, datastore: Datastore, metrics: EppMetrics, health: HealthState
    ) -> None:
        assert settings.pool.pool_file is not None
        self._datastore = datastore
        self._health = health
        self._source = PoolFileSource(
            settings.pool.pool_file,
            datastore,
            observer=metrics,
            poll_interval=settings.pool.reload_poll_interval,
            settle_time=settings.pool.reload_settle_time,
        )

    def load(self) -> None:
        self._source.load_initial()

    def tasks(self) -> list[NamedTask]:
        return [("pool-file-watch", self._source.watch())]

    async def serving(self) -> None:
        await self._health.set_ready(self._datastore.loaded)

    def note(self) -> str | None:
        if self._source.healthy:
            return None
        # Still ready: the last good pool serves; a bad edit must not take the EPP out.
        return "pool file change refused; serving the last good pool"

    async def release(self) -> None:
        pass

    async def close(self) -> None:
        pass


class KubernetesFeed:
    """The InferencePool and its pods, watched; ready at the first full sync and, with
    ``--ha-enable-leader-election``, only while this replica holds the Lease."""

    def __init__(
        self,
        settings: Settings,
        pool_name: str,
        datastore: Datastore,
        health: HealthState,
        draining: Callable[[], bool],
    ) -> None:
        from endpoint_picker.datastore.sources.kubernetes import (
            KubernetesAccessReviewer,
            KubernetesSource,
            LeaderElector,
            build_client,
            default_identity,
        )

        k8s = settings.pool.kubernetes
        self._health = health
        self._draining = draining
        self._synced = False  # the first full sync is done and the pool exists
        self._leading = not k8s.leader_election  # this replica holds the Lease
        client = build_client(k8s)
        # the metrics port's tokens are checked with the same client (when auth asks for it)
        self.reviewer: KubernetesAccessReviewer | None = KubernetesAccessReviewer(
            client, settings.server.metrics_endpoint.review_timeout
        )
        self.elector: LeaderElector | None = None
        if k8s.leader_election:
            self.elector = LeaderElector(
                client,
                k8s.namespace,
                k8s.lease_name or f"endpoint-picker-{pool_name}",
                default_identity(),
                k8s,
                self._on_leading,
            )
        source = KubernetesSource(client, datastore, pool_name, k8s, readiness=self._on_synced)
        self._source = source
        self.kubernetes: KubernetesSource | None = source

    async def _on_synced(self, ready: bool) -> None:
        self._synced = ready
        await self._update_ready()

    async def _on_leading(self, leader: bool) -> None:
        self._leading = leader
        await self._update_ready()

    async def _update_ready(self) -> None:
        # synced and (without HA, or) leading; never ready again once draining
        await self._health.set_ready(self._synced and self._leading and not self._draining())

    def load(self) -> None:
        pass  # ready at its first full sync, not before

    def tasks(self) -> list[NamedTask]:
        tasks = self._source.tasks()
        if self.elector is not None:
            tasks.append(("kubernetes-leader-election", self.elector.run()))
        return tasks

    async def serving(self) -> None:
        pass

    def note(self) -> str | None:
        if self._source.healthy:
            return None
        return "a Kubernetes watch is reconnecting; serving the last state"

    async def release(self) -> None:
        if self.elector is not None:  # a standby may lead while this replica drains
            await self.elector.release()

    async def close(self) -> None:
        await self._source.close()
