"""The Kubernetes source through the real client (lightkube) against an HTTP API-server double."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from lightkube.resources.core_v1 import Pod as KubePod
from tests.support.kubeapi import FakeKubeApi, serve_kube_api, write_kubeconfig
from tests.support.polling import until
from tests.support.pool import V1, model, objective, pod, pool

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.sources.kubernetes import (
    KubernetesSource,
    build_client,
    load_kube_config,
)
from endpoint_picker.datastore.sources.kubernetes.reflector import Reflector
from endpoint_picker.datastore.sources.kubernetes.resources import decode_pod
from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import GROUP_V1, GROUP_V1ALPHA2, KubernetesSettings
from endpoint_picker.types import Criticality

pytestmark = pytest.mark.timeout(20)

FAST = KubernetesSettings(
    group=GROUP_V1ALPHA2,  # the fixtures of tests/support/pool.py (the default is v1)
    request_timeout=2.0,
    watch_timeout=30.0,
    inactivity_timeout=30.0,
    backoff_initial=0.05,
    backoff_max=0.2,
    missing_resource_retry=0.5,
)


@dataclasses.dataclass
class Running:
    api: FakeKubeApi
    source: KubernetesSource
    store: Datastore
    readiness: list[bool]

    def hostports(self) -> list[str]:
        return [e.hostport for e in self.store.endpoints]


@contextlib.asynccontextmanager
async def running(
    tmp_path: Path,
    objects: list[dict[str, Any]],
    *,
    unserved: tuple[str, str] | None = None,
    **overrides: Any,
) -> AsyncIterator[Running]:
    async with serve_kube_api() as api:
        for obj in objects:
            api.put(obj)
        if unserved is not None:
            api.served.discard(unserved)
        settings = dataclasses.replace(
            FAST, kubeconfig=write_kubeconfig(tmp_path / "kubeconfig", api.url), **overrides
        )
        store = Datastore("pool")
        readiness: list[bool] = []

        async def record(ready: bool) -> None:
            readiness.append(ready)

        source = KubernetesSource(build_client(settings), store, "pool", settings, readiness=record)
        tasks = [asyncio.create_task(coro, name=name) for name, coro in source.tasks()]
        try:
            yield Running(api, source, store, readiness)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await source.close()


async def eventually(check: Callable[[], bool], within: float = 1.0) -> None:
    """``until`` within the issue's bound: the watch shows a change within a second."""
    await until(check, within)


MODELS = ("inference.networking.x-k8s.io/v1alpha2", "inferencemodels")
BASE = [
    pool(),
    model("base", criticality="Critical"),
    model("food-review", targets={"food-review-v1": 80, "food-review-v2": 20}),
    pod("a", "10.0.0.1"),
    pod("b", "10.0.0.2"),
    pod("c", "10.0.0.3", ready=False),
    pod("other", "10.0.0.9", labels={"app": "web"}),
]


async def test_initial_sync_builds_the_pool_and_then_reports_ready(tmp_path: Path) -> None:
    """The first full sync yields the Ready selected pods and the models, then readiness True."""
    async with running(tmp_path, BASE) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        assert r.hostports() == ["10.0.0.1:8000", "10.0.0.2:8000"]
        assert r.store.model_names() == ("base", "food-review")
        base = r.store.model("base")
        assert base is not None
        assert base.criticality is Criticality.CRITICAL
        assert r.readiness == [True]
        assert r.api.count("list") == 4  # pool, models, objectives, pods


async def test_not_ready_until_the_pool_exists(tmp_path: Path) -> None:
    """Without its InferencePool the source stays not ready; the pool's creation makes it ready."""
    async with running(tmp_path, BASE[1:]) as r:
        await eventually(lambda: r.source.pools.synced and r.source.pods.synced)
        await asyncio.sleep(0.1)
        assert r.readiness == []
        assert not r.store.loaded
        r.api.put(pool())
        await eventually(lambda: r.readiness == [True])
        assert len(r.store.endpoints) == 2


async def test_pod_lifecycle_takes_effect_within_a_second(tmp_path: Path) -> None:
    """A pod added, turned unready, relabelled out of the pool and deleted changes the pool."""
    async with running(tmp_path, BASE) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        r.api.put(pod("d", "10.0.0.4"))
        await eventually(lambda: "10.0.0.4:8000" in r.hostports())
        r.api.put(pod("d", "10.0.0.4", ready=False))
        await eventually(lambda: "10.0.0.4:8000" not in r.hostports())
        r.api.put(pod("c", "10.0.0.3"))  # becomes Ready
        await eventually(lambda: "10.0.0.3:8000" in r.hostports())
        r.api.put(pod("c", "10.0.0.3", labels={"app": "web"}))  # relabelled out
        await eventually(lambda: "10.0.0.3:8000" not in r.hostports())
        r.api.delete(pod("a", "10.0.0.1"))
        await eventually(lambda: r.hostports() == ["10.0.0.2:8000"])
        r.api.put(pod("b", "10.0.0.22"))  # a new IP
        await eventually(lambda: r.hostports() == ["10.0.0.22:8000"])
        assert r.api.count("list pods") == 1  # all of it from one watch


async def test_pods_sharing_an_ip_are_one_endpoint(tmp_path: Path) -> None:
    """Two Ready pods with one IP (hostNetwork, or a stale pod): one endpoint, served once."""
    async with running(tmp_path, BASE) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        r.api.put(pod("a-host", "10.0.0.1"))  # a second pod on a's address
        r.api.put(pod("d", "10.0.0.4"))  # then a change that shows the first was applied
        await eventually(lambda: "10.0.0.4:8000" in r.hostports())
        assert r.hostports() == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.4:8000"]
        assert [e.pod_name for e in r.store.endpoints] == ["a", "b", "d"]
        state = r.store.state
        assert state is not None
        assert [d.pods for d in state.duplicates] == [("default/a", "default/a-host")]


async def test_terminating_pod_leaves_the_pool(tmp_path: Path) -> None:
    """A pod with a deletionTimestamp (still Ready while it drains) gets no new requests."""
    async with running(tmp_path, BASE) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        leaving = pod("a", "10.0.0.1")
        leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        r.api.put(leaving)
        await eventually(lambda: r.hostports() == ["10.0.0.2:8000"])


async def test_selector_change_switches_pods_without_a_new_list(tmp_path: Path) -> None:
    """An edited pool selector takes effect at once from the namespace's pods already held."""
    async with running(tmp_path, BASE) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        r.api.put(pool(selector={"app": "web"}, port=9000))
        await eventually(lambda: r.hostports() == ["10.0.0.9:9000"])
        assert r.api.count("list pods") == 1


async def test_v1_pool_group(tmp_path: Path) -> None:
    """--pool-group inference.networking.k8s.io watches the v1 InferencePool (targetPorts)."""
    objects = [pool(api=V1, ports=[8000, 8001]), *BASE[3:5]]
    async with running(tmp_path, objects, group=GROUP_V1) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        assert r.hostports() == [
            "10.0.0.1:8000",
            "10.0.0.1:8001",
            "10.0.0.2:8000",
            "10.0.0.2:8001",
        ]
        assert r.store.pool is not None
        assert r.store.pool.passes_unknown_models


async def test_model_changes_take_effect(tmp_path: Path) -> None:
    """InferenceModels edited, added and deleted change the pool's models within a second."""
    async with running(tmp_path, BASE) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        r.api.put(model("base", criticality="Sheddable"))
        await eventually(
            lambda: getattr(r.store.model("base"), "criticality", None) is Criticality.SHEDDABLE
        )
        r.api.put(model("chat"))
        r.api.put(model("elsewhere", pool_ref="another-pool"))
        await eventually(lambda: "chat" in r.store.model_names())
        r.api.delete(model("food-review"))
        await eventually(lambda: r.store.model_names() == ("base", "chat"))


async def test_objective_changes_take_effect(tmp_path: Path) -> None:
    """InferenceObjectives of the pool arrive, change and leave; other pools' are ignored."""
    async with running(tmp_path, [*BASE, objective("batch", priority=-1)]) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        batch = r.store.objective("batch")
        assert batch is not None
        assert batch.priority == -1
        r.api.put(objective("batch", priority=5))
        r.api.put(objective("theirs", pool_ref="another-pool"))
        await eventually(lambda: getattr(r.store.objective("batch"), "priority", None) == 5)
        assert r.store.objective("theirs") is None
        r.api.delete(objective("batch"))
        await eventually(lambda: r.store.objective("batch") is None)


async def test_410_gone_mid_watch_lists_again(tmp_path: Path) -> None:
    """A 410 ERROR event mid-watch makes each kind list again; changes since then are not lost."""
    async with running(tmp_path, BASE) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        await eventually(lambda: r.source.healthy)
        r.api.expire()
        r.api.put(pod("d", "10.0.0.4"))
        await eventually(lambda: "10.0.0.4:8000" in r.hostports())
        await eventually(lambda: r.api.count("list pods") == 2)
        r.api.delete(pod("b", "10.0.0.2"))
        await eventually(lambda: r.hostports() == ["10.0.0.1:8000", "10.0.0.4:8000"])


async def test_dropped_connection_reconnects_from_the_last_version(tmp_path: Path) -> None:
    """A watch cut mid-stream is reopened after a backoff from the last version, without a list;
    what changed meanwhile arrives."""
    async with running(tmp_path, BASE) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        await eventually(lambda: r.source.healthy)
        # healthy comes with the lists; the watch may open a moment later (first on Python 3.12)
        await eventually(lambda: r.api.count("watch pods") == 1)
        r.api.drop()
        r.api.delete(pod("a", "10.0.0.1"))  # while no watch is open
        await eventually(lambda: r.hostports() == ["10.0.0.2:8000"])
        assert r.api.count("list pods") == 1
        assert r.api.count("watch pods") == 2
        assert r.readiness == [True]  # the last state served throughout


async def test_model_crd_removed_then_installed(tmp_path: Path) -> None:
    """A kind whose list answers 404 counts as empty and is looked for again until it is served."""
    async with running(tmp_path, BASE) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        r.api.served.discard(MODELS)
        r.api.expire()  # everyone lists again; InferenceModels now 404
        await eventually(lambda: r.store.model_names() == ())
        r.api.served.add(MODELS)
        await eventually(lambda: r.store.model_names() == ("base", "food-review"), within=2)


async def test_missing_model_crd_still_syncs(tmp_path: Path) -> None:
    """Without the InferenceModel CRD the pool syncs with no models (and becomes ready)."""
    async with running(tmp_path, [pool(), *BASE[3:5]], unserved=MODELS) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        assert r.store.model_names() == ()
        assert len(r.store.endpoints) == 2


async def test_failing_lists_are_retried_with_backoff(tmp_path: Path) -> None:
    """Lists answered 500 are retried (backoff) until they succeed; ready only after that."""
    async with serve_kube_api() as api:
        api.failing_lists = 6
        for obj in BASE:
            api.put(obj)
        settings = dataclasses.replace(
            FAST, kubeconfig=write_kubeconfig(tmp_path / "kubeconfig", api.url)
        )
        store = Datastore("pool")
        source = KubernetesSource(build_client(settings), store, "pool", settings)
        tasks = [asyncio.create_task(coro, name=name) for name, coro in source.tasks()]
        try:
            await asyncio.wait_for(source.synced.wait(), 5)
            assert api.failing_lists == 0
            assert api.count("list") == 10  # six refused, four served
            assert len(store.endpoints) == 2
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await source.close()


async def test_pool_deleted_is_not_ready_and_recreated_is_ready(tmp_path: Path) -> None:
    """Deleting the InferencePool reports not ready; creating it again reports ready."""
    async with running(tmp_path, BASE) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        r.api.delete(pool())
        await eventually(lambda: r.readiness == [True, False])
        r.api.put(pool(port=8080))
        await eventually(lambda: r.readiness == [True, False, True])
        assert r.hostports() == ["10.0.0.1:8080", "10.0.0.2:8080"]


async def test_silent_watch_is_reopened_after_the_inactivity_timeout(tmp_path: Path) -> None:
    """A watch that stays silent past the inactivity timeout is dropped and opened again."""
    async with running(tmp_path, BASE, inactivity_timeout=0.2) as r:
        await asyncio.wait_for(r.source.synced.wait(), 2)
        await eventually(lambda: r.api.count("watch pods") >= 3, within=2)
        assert r.api.count("list pods") == 1
        r.api.put(pod("d", "10.0.0.4"))
        await eventually(lambda: "10.0.0.4:8000" in r.hostports())


def test_missing_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    """A --kubeconfig that does not exist is one clear ConfigError (exit 2 at the CLI)."""
    with pytest.raises(ConfigError, match="cannot load Kubernetes credentials"):
        build_client(dataclasses.replace(FAST, kubeconfig=tmp_path / "nope"))


def test_kubeconfig_env_is_a_path_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$KUBECONFIG may list several files (as kubectl reads it): the first existing one is used."""
    real = write_kubeconfig(tmp_path / "real", "http://127.0.0.9:6443")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}{os.pathsep}{real}")
    config = load_kube_config(None).get()
    assert config.cluster.server == "http://127.0.0.9:6443"


async def test_backoff_grows_while_failing_and_starts_over_after_progress(tmp_path: Path) -> None:
    """Failed lists back off exponentially (with jitter); after a success the next disconnect
    waits the initial delay again."""
    async with serve_kube_api() as api:
        api.put(pod("a", "10.0.0.1"))
        api.failing_lists = 3
        settings = dataclasses.replace(
            FAST,
            kubeconfig=write_kubeconfig(tmp_path / "kubeconfig", api.url),
            backoff_initial=0.04,
            backoff_max=1.0,
        )
        delays: list[float] = []

        async def sleep(seconds: float) -> None:
            delays.append(seconds)
            await asyncio.sleep(0.01)

        client = build_client(settings)
        changes: list[int] = []
        reflector = Reflector(
            "Pod",
            client,
            KubePod,
            "default",
            decode_pod,
            lambda: changes.append(1),
            settings,
            sleep=sleep,
        )
        task = asyncio.create_task(reflector.run())
        try:
            await eventually(lambda: reflector.connected, within=2)
            assert len(delays) == 3
            for n, delay in enumerate(delays):
                assert 0.02 * 2**n <= delay <= 0.04 * 2**n
            # "connected" is set as the watch is sent: cut it once the server holds it
            await eventually(lambda: bool(api.watches))
            api.drop()
            await eventually(lambda: len(delays) == 4)
            assert delays[3] <= 0.04
            api.put(pod("b", "10.0.0.2"))
            await eventually(lambda: set(reflector.objects) == {"a", "b"})
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
