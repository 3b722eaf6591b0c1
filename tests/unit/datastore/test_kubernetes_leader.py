"""Leader election over a coordination.k8s.io Lease, through the real client and HTTP double."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.support.kubeapi import FakeKubeApi, serve_kube_api, write_kubeconfig
from tests.support.polling import until

from endpoint_picker.datastore.sources.kubernetes import LeaderElector, build_client
from endpoint_picker.settings import KubernetesSettings

pytestmark = pytest.mark.timeout(20)

FAST = KubernetesSettings(
    request_timeout=2.0, lease_duration=1.0, renew_deadline=0.6, retry_period=0.1
)
LEASES = ("coordination.k8s.io/v1", "leases")


@dataclasses.dataclass
class Candidate:
    elector: LeaderElector
    task: asyncio.Task[None]
    changes: list[bool]


@contextlib.asynccontextmanager
async def candidates(
    tmp_path: Path, count: int
) -> AsyncIterator[tuple[FakeKubeApi, list[Candidate]]]:
    async with serve_kube_api() as api:
        settings = dataclasses.replace(
            FAST, kubeconfig=write_kubeconfig(tmp_path / "kubeconfig", api.url)
        )
        clients = [build_client(settings) for _ in range(count)]
        out: list[Candidate] = []
        for i, client in enumerate(clients):
            changes: list[bool] = []

            async def record(leader: bool, changes: list[bool] = changes) -> None:
                changes.append(leader)

            elector = LeaderElector(client, "default", "epp", f"replica-{i}", settings, record)
            out.append(Candidate(elector, asyncio.create_task(elector.run()), changes))
            await asyncio.sleep(0.05)  # replica-0 asks first
        try:
            yield api, out
        finally:
            for c in out:
                c.task.cancel()
            await asyncio.gather(*(c.task for c in out), return_exceptions=True)
            for client in clients:
                await client.close()


async def test_one_leader_and_takeover_after_the_lease_expires(tmp_path: Path) -> None:
    """One replica leads; when it stops renewing, another takes over after the lease duration."""
    async with candidates(tmp_path, 2) as (api, (a, b)):
        await until(lambda: a.elector.leader, within=2)
        await asyncio.sleep(0.5)
        assert not b.elector.leader
        assert api.objects[LEASES][("default", "epp")]["spec"]["holderIdentity"] == "replica-0"
        a.task.cancel()  # a crash: no release
        loop = asyncio.get_running_loop()
        stopped = loop.time()
        await until(lambda: b.elector.leader, within=3)
        assert loop.time() - stopped >= 0.8  # waited for the lease to run out
        assert b.changes == [True]
        lease = api.objects[LEASES][("default", "epp")]["spec"]
        assert lease["holderIdentity"] == "replica-1"
        assert lease["leaseTransitions"] == 1


async def test_release_hands_over_at_the_next_look(tmp_path: Path) -> None:
    """A leader that releases (a graceful stop) is replaced within a retry period or two."""
    async with candidates(tmp_path, 2) as (_, (a, b)):
        await until(lambda: a.elector.leader, within=2)
        await a.elector.release()
        assert a.changes == [True, False]
        await until(lambda: b.elector.leader, within=0.5)
        await asyncio.sleep(0.3)
        assert not a.elector.leader  # released for good: it never competes again


async def test_leader_that_cannot_renew_steps_down(tmp_path: Path) -> None:
    """A leader whose renewals fail for longer than the renew deadline stops leading."""
    async with candidates(tmp_path, 1) as (api, (a,)):
        await until(lambda: a.elector.leader, within=2)
        api.served.discard(LEASES)  # every lease request now fails
        await until(lambda: not a.elector.leader, within=2)
        assert a.changes == [True, False]
        api.served.add(LEASES)
        await until(lambda: a.elector.leader, within=2)
