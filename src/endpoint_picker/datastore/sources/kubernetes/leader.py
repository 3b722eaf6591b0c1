"""Active-passive HA: a ``coordination.k8s.io/v1`` Lease decides which replica is the leader.

The algorithm of client-go's leader election, in a few lines. Every ``retry_period`` a replica
reads the Lease:

- no Lease: create it, holding it (a conflicting create means another replica was first);
- held by this replica: renew it (``renewTime``);
- held by another: the holder is presumed alive while the Lease record keeps changing; once it
  has stayed the same for ``lease_duration`` (timed on this replica's monotonic clock, so clock
  skew between nodes does not matter) it is taken over.

Writes replace the object at the version read, so two replicas racing for it cannot both win
(the loser gets 409 Conflict). A leader that cannot renew for ``renew_deadline`` steps down. On
stop the leader releases the Lease (empty holder), so a standby takes over at its next look
instead of waiting out the lease. Only the leader reports ready; standbys keep their watches
warm.
"""

from __future__ import annotations

import asyncio
import datetime
import socket
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx2
import structlog
from lightkube import AsyncClient
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

from endpoint_picker.datastore.sources.kubernetes.reflector import status_code
from endpoint_picker.settings import KubernetesSettings

log = structlog.get_logger(__name__)

LeadershipSink = Callable[[bool], Awaitable[None]]


def default_identity() -> str:
    """This replica in the Lease: the pod's name (its hostname) and a random suffix, so a
    restarted pod is a new candidate."""
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class LeaderElector:
    """Holds or waits for the Lease ``name``; ``leader`` says which, ``on_change`` is told."""

    def __init__(
        self,
        client: AsyncClient,
        namespace: str,
        name: str,
        identity: str,
        settings: KubernetesSettings,
        on_change: LeadershipSink,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._client = client
        self._namespace = namespace
        self.name = name
        self.identity = identity
        self._settings = settings
        self._on_change = on_change
        self._clock = clock
        self._sleep = sleep
        self.leader = False
        self._released = False  # stopping: never acquire again
        self._renewed_at = 0.0
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0

    async def run(self) -> None:
        """Try to acquire or renew every ``retry_period``, forever (a named app task)."""
        while not self._released:
            try:
                async with asyncio.timeout(self._settings.request_timeout):
                    held = await self._acquire_or_renew()
            except Exception as exc:  # HTTP, connection, timeout: not holding it now
                held = False
                log.warning(
                    "leader election: lease not reachable",
                    lease=self.name,
                    error=f"{type(exc).__name__}: {exc}",
                )
            now = self._clock()
            if self._released:
                return
            if held:
                self._renewed_at = now
                await self._set(True)
            elif self.leader and now - self._renewed_at > self._settings.renew_deadline:
                await self._set(False)
            await self._sleep(self._settings.retry_period)

    async def _acquire_or_renew(self) -> bool:
        try:
            lease = await self._client.get(Lease, self.name, namespace=self._namespace)
        except httpx2.HTTPStatusError as exc:  # ApiError is one
            if status_code(exc) != 404:
                raise
            return await self._create()
        spec = lease.spec or LeaseSpec()
        holder = spec.holderIdentity or ""
        record = (holder, str(spec.renewTime))
        now = self._clock()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = spec.leaseDurationSeconds or self._settings.lease_duration
        if holder and holder != self.identity and now - self._observed_at < duration:
            if self.leader:  # someone else took it over
                await self._set(False)
            return False
        stamp = _now()
        if holder != self.identity:
            spec.acquireTime = stamp
            spec.leaseTransitions = (spec.leaseTransitions or 0) + 1
        spec.holderIdentity = self.identity
        spec.renewTime = stamp
        spec.leaseDurationSeconds = int(self._settings.lease_duration)
        lease.spec = spec
        try:
            await self._client.replace(lease)
        except httpx2.HTTPStatusError as exc:
            if status_code(exc) == 409:  # another replica wrote first
                return False
            raise
        return True

    async def _create(self) -> bool:
        stamp = _now()
        lease = Lease(
            metadata=ObjectMeta(name=self.name, namespace=self._namespace),
            spec=LeaseSpec(
                holderIdentity=self.identity,
                leaseDurationSeconds=int(self._settings.lease_duration),
                acquireTime=stamp,
                renewTime=stamp,
                leaseTransitions=0,
            ),
        )
        try:
            await self._client.create(lease)
        except httpx2.HTTPStatusError as exc:
            if status_code(exc) == 409:
                return False
            raise
        return True

    async def release(self) -> None:
        """Stop competing and give the Lease up (best effort, bounded), so a standby takes over
        at its next look."""
        self._released = True
        if not self.leader:
            return
        await self._set(False)
        try:
            async with asyncio.timeout(self._settings.request_timeout):
                lease = await self._client.get(Lease, self.name, namespace=self._namespace)
                if lease.spec is None or lease.spec.holderIdentity != self.identity:
                    return
                lease.spec.holderIdentity = ""
                lease.spec.leaseDurationSeconds = 1
                lease.spec.renewTime = _now()
                await self._client.replace(lease)
        except Exception as exc:  # stopping anyway: the lease then expires on its own
            log.warning("leader election: release failed", lease=self.name, error=str(exc))

    async def _set(self, leader: bool) -> None:
        if leader == self.leader:
            return
        self.leader = leader
        log.info(
            "leader election: leading" if leader else "leader election: standing by",
            lease=self.name,
            identity=self.identity,
        )
        await self._on_change(leader)
