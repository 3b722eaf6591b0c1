"""CPU cost of one request through the ext_proc state machine (no gRPC, no network).

Run: .venv/bin/python benchmarks/bench_stream.py [--endpoints 16] [--requests 20000]
         [--config deploy/examples/scheduler-config.yaml] [--chat-kb 200]

``--chat-kb N`` sends a chat request of about N KB (a long conversation) instead of a short
completion: with a prefix-cache profile that measures hashing a long prompt on the request
path. ``--config`` takes an EndpointPickerConfig (default: the built-in default profile).

Feeds ``RequestStream`` the messages Envoy sends for one full-duplex request (headers, one body
chunk, response headers, one response chunk) and reports microseconds per request, split into
the director (parse, model, split, scheduling) and the rest (protobuf building, bookkeeping).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import orjson

from endpoint_picker.bench.lone import body, headers, pool_text, response_body, response_headers
from endpoint_picker.bench.stats import percentile
from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.director import Director
from endpoint_picker.exchange import Lifecycle
from endpoint_picker.extproc.stream import RequestStream
from endpoint_picker.scheduling import build_scheduling, load_config
from endpoint_picker.settings import SchedulingSettings
from endpoint_picker.telemetry.logs import configure_logging
from endpoint_picker.telemetry.metrics import EppMetrics
from endpoint_picker.types import MetricsSnapshot


def build(endpoints: int, config_text: str | None) -> tuple[Director, EppMetrics]:
    addresses = [f"127.0.{i // 250}.{i % 250 + 2}" for i in range(endpoints)]
    store = Datastore()
    store.apply(parse_pool_text(pool_text(addresses, "m", targets={"m-a": 1, "m-b": 1}), "b"))
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
        None if config_text is None else load_config(config_text),
        settings=SchedulingSettings(),
        staleness_threshold=2.0,
        observer=metrics,
    )
    director = Director(
        store, parts.scheduler, parts.saturation_detector, lifecycle=Lifecycle.of(parts.subscribers)
    )
    return director, metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--config", type=Path, help="an EndpointPickerConfig file")
    parser.add_argument("--chat-kb", type=int, default=0, help="a chat prompt of this size")
    args = parser.parse_args()
    configure_logging("text", "info")
    director, metrics = build(args.endpoints, args.config.read_text() if args.config else None)
    if args.chat_kb:
        turn = "The quick brown fox jumps over the lazy dog. " * 22  # about 1 KB
        messages_json = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": turn}
            for i in range(args.chat_kb)
        ]
        prompt = orjson.dumps({"model": "m", "messages": messages_json, "max_tokens": 100})
        path = "/v1/chat/completions"
    else:
        prompt = orjson.dumps({"model": "m", "prompt": "word " * 200, "max_tokens": 100})
        path = "/v1/completions"
    messages = [
        headers(path, extra={"x-request-id": "bench"}),
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
    median, p99 = (percentile(samples, 50) or 0.0) * 1e6, (percentile(samples, 99) or 0.0) * 1e6
    print(
        f"endpoints={args.endpoints} requests={args.requests} body={len(prompt)} bytes: "
        f"median {median:.1f} us, p99 {p99:.1f} us per request (state machine + director)"
    )


if __name__ == "__main__":
    main()
