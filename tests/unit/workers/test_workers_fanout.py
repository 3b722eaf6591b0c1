"""The parent's fan-out: each change sent once per frame, a new worker caught up."""

from __future__ import annotations

import asyncio
import pickle

from endpoint_picker.datastore.objects import ClusterState, InferencePool, Pod
from endpoint_picker.types import MetricsSnapshot
from endpoint_picker.workers.fanout import (
    FLUSH_DELAY,
    FRAME_SNAPSHOTS,
    Publisher,
    PublishingDatastore,
)
from endpoint_picker.workers.messages import (
    MetricsUpdate,
    PoolUpdate,
    Readiness,
    Unreachable,
)
from endpoint_picker.workers.table import SlotMap


def cluster(*ips: str) -> ClusterState:
    pool = InferencePool(
        "pool", "ns", "inference.networking.x-k8s.io/v1alpha2", (("a", "b"),), (8000,)
    )
    pods = tuple(Pod(f"p{ip}", "ns", (("a", "b"),), ip, True) for ip in ips)
    return ClusterState(pools=(pool,), pods=pods)


def decode(frames: list[bytes]) -> list[object]:
    return [pickle.loads(frame[4:]) for frame in frames]


async def test_snapshots_within_the_delay_share_one_frame() -> None:
    """Scrapes finishing within FLUSH_DELAY are one MetricsUpdate, sent when it has passed, with
    the newest snapshot of each endpoint; a removed pod's late one is not sent."""
    frames: list[bytes] = []
    datastore = PublishingDatastore(None, Publisher(SlotMap(), frames.append))
    datastore.apply(cluster("127.0.0.2", "127.0.0.3", "127.0.0.4"))
    first, second, third = datastore.endpoints
    datastore.update_metrics(first, MetricsSnapshot(waiting_queue_size=1, updated_at=1.0))
    datastore.update_metrics(second, MetricsSnapshot(waiting_queue_size=2, updated_at=1.0))
    datastore.update_metrics(first, MetricsSnapshot(waiting_queue_size=3, updated_at=1.1))
    await asyncio.sleep(0)
    messages = decode(frames)
    assert [type(m) for m in messages] == [PoolUpdate]  # nothing before the delay
    assert dict(messages[0].slots) == {first.hostport: 0, second.hostport: 1, third.hostport: 2}
    await asyncio.sleep(FLUSH_DELAY * 2)
    (update,) = decode(frames[1:])
    assert update == MetricsUpdate(
        (
            (first, MetricsSnapshot(waiting_queue_size=3, updated_at=1.1)),
            (second, MetricsSnapshot(waiting_queue_size=2, updated_at=1.0)),
        )
    )
    frames.clear()
    datastore.apply(cluster("127.0.0.2"))
    datastore.update_metrics(second, MetricsSnapshot(updated_at=2.0))  # a late scrape
    await asyncio.sleep(FLUSH_DELAY * 2)
    assert [type(m) for m in decode(frames)] == [PoolUpdate]


async def test_an_unreachable_mark_follows_the_snapshots_gathered_before_it() -> None:
    """A mark goes out at once, after the gathered snapshots (a worker clears a mark on a
    snapshot, so one sent later would undo it); a repeated mark is not sent again."""
    frames: list[bytes] = []
    datastore = PublishingDatastore(None, Publisher(SlotMap(), frames.append))
    datastore.apply(cluster("127.0.0.2", "127.0.0.3"))
    _, second = datastore.endpoints
    frames.clear()
    datastore.update_metrics(second, MetricsSnapshot(waiting_queue_size=2, updated_at=1.0))
    datastore.mark_unreachable(second.hostport, "refused")
    datastore.mark_unreachable(second.hostport, "refused")  # no change: not sent again
    assert decode(frames) == [
        MetricsUpdate(((second, MetricsSnapshot(waiting_queue_size=2, updated_at=1.0)),)),
        Unreachable(second.hostport, "refused"),
    ]
    await asyncio.sleep(FLUSH_DELAY * 2)
    assert len(frames) == 2


async def test_many_snapshots_go_out_in_bounded_frames() -> None:
    """A burst of scrapes is several frames of at most FRAME_SNAPSHOTS, every snapshot once, in
    order (a worker reads its ext_proc sockets between two frames); full frames go at once."""
    frames: list[bytes] = []
    datastore = PublishingDatastore(None, Publisher(SlotMap(), frames.append))
    count = 2 * FRAME_SNAPSHOTS + 5
    datastore.apply(cluster(*(f"127.0.1.{i + 2}" for i in range(count))))
    frames.clear()
    for n, endpoint in enumerate(datastore.endpoints):
        datastore.update_metrics(endpoint, MetricsSnapshot(waiting_queue_size=n, updated_at=1.0))
    assert len(frames) == 2  # the full ones
    await asyncio.sleep(FLUSH_DELAY * 2)
    updates = decode(frames)
    assert all(isinstance(m, MetricsUpdate) for m in updates)
    sizes = [len(m.snapshots) for m in updates]  # type: ignore[attr-defined]
    assert sizes == [FRAME_SNAPSHOTS, FRAME_SNAPSHOTS, 5]
    sent = [s.waiting_queue_size for m in updates for _, s in m.snapshots]  # type: ignore[attr-defined]
    assert sent == list(range(count))


async def test_a_new_worker_is_caught_up_with_the_present() -> None:
    """catch_up: the pool, the latest snapshot of each endpoint, unreachable marks, readiness."""
    publisher = Publisher(SlotMap(), lambda frame: None)
    datastore = PublishingDatastore(None, publisher)
    datastore.apply(cluster("127.0.0.2", "127.0.0.3"))
    first, second = datastore.endpoints
    for at in (1.0, 2.0):
        datastore.update_metrics(first, MetricsSnapshot(updated_at=at))
    datastore.mark_unreachable(second.hostport, "refused")
    publisher.readiness(True)
    await asyncio.sleep(0)
    messages = decode(list(publisher.catch_up()))
    assert isinstance(messages[0], PoolUpdate)
    assert messages[1] == MetricsUpdate(((first, MetricsSnapshot(updated_at=2.0)),))
    assert messages[2:] == [Unreachable(second.hostport, "refused"), Readiness(True)]
