"""What one metrics fan-out to the workers costs (``epp serve --workers N``).

Run: ``.venv/bin/python benchmarks/bench_worker_fanout.py``

16 endpoints scraped every 50 ms (320 snapshots/s), each finished scrape published as its own
frame (the worst case: scrapes are spread over the interval, so they rarely share a loop turn)
to 2 workers over socketpairs. Parent: pickle once + one write per worker. Worker: read,
unpickle, ``Datastore.update_metrics``. CPU is ``time.process_time`` (user + kernel).
"""

from __future__ import annotations

import asyncio
import socket
import time

import structlog

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.objects import ClusterState, InferencePool, Pod
from endpoint_picker.types import MetricsSnapshot
from endpoint_picker.workers.messages import MetricsUpdate, encode, read_message

ENDPOINTS, RATE, SECONDS, WORKERS = 16, 20, 10, 2
SNAPSHOT = MetricsSnapshot(
    3, 5, 0.42, frozenset({"lora-a", "lora-b"}), frozenset(), 4, frozenset({"base"}), 16, 8192, 1.0
)


def datastore() -> Datastore:
    api = "inference.networking.x-k8s.io/v1alpha2"
    pool = InferencePool("pool", "ns", api, (("a", "b"),), (8000,))
    pods = tuple(Pod(f"p{i}", "ns", (("a", "b"),), f"127.0.1.{i}", True) for i in range(ENDPOINTS))
    store = Datastore()
    store.apply(ClusterState(pools=(pool,), pods=pods))
    return store


async def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    store = datastore()
    pairs = [socket.socketpair() for _ in range(WORKERS)]
    out = [await asyncio.open_unix_connection(sock=ours) for ours, _ in pairs]
    into = [await asyncio.open_unix_connection(sock=theirs) for _, theirs in pairs]
    endpoints, count = store.endpoints, ENDPOINTS * RATE * SECONDS
    started = time.process_time()
    for i in range(count):
        frame = encode(MetricsUpdate(((endpoints[i % ENDPOINTS], SNAPSHOT),)))
        for _, writer in out:
            writer.write(frame)
        if i % 64 == 63:
            await asyncio.sleep(0)
    parent = time.process_time() - started
    started = time.process_time()
    reader = into[0][0]
    for _ in range(count):
        message = await read_message(reader)
        assert isinstance(message, MetricsUpdate)
        for endpoint, snapshot in message.snapshots:
            store.update_metrics(endpoint, snapshot)
    worker = time.process_time() - started
    per_second = ENDPOINTS * RATE
    print(f"frame: {len(frame)} bytes per snapshot")
    print(
        f"parent: {parent / count * 1e6:.1f} µs per snapshot for {WORKERS} workers, "
        f"{parent / count * per_second * 100:.2f}% of a core at {per_second} snapshots/s"
    )
    print(
        f"each worker: {worker / count * 1e6:.1f} µs per snapshot, "
        f"{worker / count * per_second * 100:.2f}% of a core"
    )
    for _, writer in out + into:
        writer.close()


if __name__ == "__main__":
    asyncio.run(main())
