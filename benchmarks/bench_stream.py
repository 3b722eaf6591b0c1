"""CPU cost of one request through the ext_proc state machine (no gRPC, no network).

Run: .venv/bin/python benchmarks/bench_stream.py [--endpoints 16] [--requests 20000]

Feeds ``RequestStream`` the messages Envoy sends for one full-duplex request (headers, one body
chunk, response headers, one response chunk) and reports microseconds per request, split into
the director (parse, model, split, scheduling) and the rest (protobuf building, bookkeeping).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tests.support.extproc import body, headers, json_body, response_body, response_headers
from tests.support.pool import model, pod, pool, pool_yaml

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.director import Director
from endpoint_picker.extproc.stream import RequestStream
from endpoint_picker.scheduling import build_scheduling
from endpoint_picker.settings import SchedulingSettings
from endpoint_picker.telemetry.logs import configure_logging
from endpoint_picker.telemetry.metrics import EppMetrics
from endpoint_picker.types import MetricsSnapshot


def build(endpoints: int) -> tuple[Director, EppMetrics]:
    pods = [pod(f"p{i}", f"127.0.{i // 250}.{i % 250 + 2}") for i in range(endpoints)]
    store = Datastore()
    store.apply(
        parse_pool_text(pool_yaml(pool(), model("m", targets={"m-a": 1, "m-b": 1}), *pods), "b")
    )
    rng = random.Random(1)
    for e in store.endpoints:
        store.update_metrics(
            e,
            MetricsSnapshot(
                waiting_queue_size=rng.randint(0, 8),
                kv_cache_usage=rng.random(),
                active_adapters=frozenset({"m-a"}),
                max_active_adapters=4,
                updated_at=time.monotonic() + 3600,
            ),
        )
    metrics = EppMetrics()
    parts = build_scheduling(
        None, settings=SchedulingSettings(), staleness_threshold=2.0, observer=metrics
    )
    return Director(store, parts.scheduler, parts.saturation_detector), metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    configure_logging("text", "info")
    director, metrics = build(args.endpoints)
    prompt = json_body({"model": "m", "prompt": "word " * 200, "max_tokens": 100})
    messages = [
        headers(extra={"x-request-id": "bench"}),
        body(prompt),
        response_headers(),
        response_body(b'{"usage": {"prompt_tokens": 200, "completion_tokens": 100}}'),
    ]
    samples = []
    for _ in range(args.requests):
        start = time.perf_counter()
        stream = RequestStream(director, metrics)
        for message in messages:
            stream.handle(message)
        stream.close()
        samples.append(time.perf_counter() - start)
    samples.sort()
    median = statistics.median(samples) * 1e6
    p99 = samples[int(len(samples) * 0.99)] * 1e6
    print(
        f"endpoints={args.endpoints} requests={args.requests}: "
        f"median {median:.1f} us, p99 {p99:.1f} us per request (state machine + director)"
    )


if __name__ == "__main__":
    main()
