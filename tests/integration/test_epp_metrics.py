"""The EPP's own Prometheus metrics after a known sequence of requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from tests.support.extproc import (
    body,
    completion,
    headers,
    json_body,
    make_settings,
    response_body,
    response_headers,
    running_app,
)
from tests.support.pool import model, pod, pool, pool_yaml

from endpoint_picker.app import App

TEXT = pool_yaml(pool(), model("m", targets={"m-v1": 1}), pod("a", "127.0.0.2"))


def sample(families: dict[str, list[Sample]], metric: str, **labels: str) -> float:
    for s in families[metric]:
        if s.labels == labels:
            return float(s.value)
    raise AssertionError(f"no sample {metric}{labels}")


async def test_metrics_after_known_requests(tmp_path: Path) -> None:
    """Counts, errors, sizes, tokens, running requests, pool and scheduler metrics are exported."""
    request = json_body({"model": "m", "prompt": "hello"})
    sse = b'data: {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 30}}\n\n'
    async with running_app(make_settings(tmp_path, TEXT)) as (app, client):
        for _ in range(2):
            await client.exchange(
                [
                    headers(),
                    body(request),
                    response_headers("text/event-stream"),
                    response_body(sse),
                ]
            )
        await client.exchange(completion("nope"))
        await client.exchange([headers("/v1/models", method="GET", end_of_stream=True)])
        await client.exchange(
            [headers(), body(request), response_headers(status=503), response_body(b"{}")]
        )
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{app.ports.metrics}/metrics") as reply,
        ):
            assert reply.status == 200
            text = await reply.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {name: f.samples for name, f in families.items()}
    m = {"model_name": "m", "target_model_name": "m-v1"}
    assert families["inference_model_request"].type == "counter"
    request_total = [
        s for s in families["inference_model_request"].samples if s.name.endswith("_total")
    ]
    assert [(s.labels, s.value) for s in request_total] == [(m, 3.0)]
    errors = [
        s for s in families["inference_model_request_error"].samples if s.name.endswith("_total")
    ]
    assert [(s.labels, s.value) for s in errors] == [
        (
            # an unknown model the EPP refuses never becomes a series of its own
            {"model_name": "other", "target_model_name": "other", "error_code": "BadConfiguration"},
            1.0,
        ),
        ({**m, "error_code": "ModelServerError"}, 1.0),
    ]
    # the reference EPP's buckets, exactly
    request_le = {
        s.labels["le"]
        for s in families["inference_model_request_sizes"].samples
        if "le" in s.labels
    }
    assert "32768.0" in request_le
    assert "32778.0" not in request_le
    output_le = sorted(
        float(s.labels["le"])
        for s in families["inference_model_output_tokens"].samples
        if "le" in s.labels
    )
    assert output_le[-2:] == [8192.0, float("inf")]
    # a request without a model (GET /v1/models) is not model traffic
    assert all(s.labels.get("model_name") != "" for f in families.values() for s in f.samples)
    assert families["inference_model_input_tokens"].type == "histogram"
    tokens = {
        s.name: s.value
        for s in families["inference_model_output_tokens"].samples
        if s.labels.get("le") in (None, "32.0")
    }
    assert tokens["inference_model_output_tokens_sum"] == 60.0
    assert tokens["inference_model_output_tokens_count"] == 2.0  # the 503 had no usage
    inputs = {
        s.name: s.value
        for s in families["inference_model_input_tokens"].samples
        if "le" not in s.labels
    }
    assert inputs["inference_model_input_tokens_sum"] == 24.0
    sizes = {
        s.name: s.value
        for s in families["inference_model_request_sizes"].samples
        if "le" not in s.labels
    }
    assert sizes["inference_model_request_sizes_sum"] == 3.0 * len(request)
    assert sample(samples, "inference_model_running_requests", model_name="m") == 0.0
    assert sample(samples, "inference_pool_ready_pods", name="pool") == 1.0
    assert families["inference_pool_average_kv_cache_utilization"].type == "gauge"
    assert families["inference_pool_average_queue_size"].type == "gauge"
    e2e = {
        s.name: s.value
        for s in families["inference_extension_scheduler_e2e_duration_seconds"].samples
    }
    assert (
        e2e["inference_extension_scheduler_e2e_duration_seconds_count"] == 3.0
    )  # GET /v1/models is answered by the EPP, not scheduled
    plugin_labels = {
        (s.labels["extension_point"], s.labels["plugin_type"])
        for s in families["inference_extension_plugin_duration_seconds"].samples
    }
    assert ("Scorer", "queue-scorer") in plugin_labels
    assert ("Picker", "max-score-picker") in plugin_labels
    durations = {
        s.name: s.value
        for s in families["inference_model_request_duration_seconds"].samples
        if "le" not in s.labels
    }
    assert durations["inference_model_request_duration_seconds_count"] == 3.0


async def test_invalid_usage_and_process_metrics_on_the_metrics_port(tmp_path: Path) -> None:
    """Junk usage is counted, not observed; process_* and scraping metrics are served."""
    request = json_body({"model": "m", "prompt": "hello"})
    junk = b'{"usage": {"prompt_tokens": -12, "completion_tokens": 30}}'
    settings = make_settings(tmp_path, TEXT)
    async with running_app(settings) as (app, client):
        await client.exchange([headers(), body(request), response_headers(), response_body(junk)])
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{app.ports.metrics}/metrics") as reply,
        ):
            text = await reply.text()
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    invalid = samples["inference_extension_model_server_invalid_usage_total"]
    assert (invalid.labels, invalid.value) == ({"model_name": "m", "target_model_name": "m-v1"}, 1)
    assert "inference_model_input_tokens_count" not in samples
    assert samples["process_resident_memory_bytes"].value > 0
    assert samples["process_open_fds"].value > 0
    # scraping: one endpoint is far from stretching the interval past its setting
    interval = samples["inference_extension_metrics_refresh_interval_seconds"].value
    assert interval == settings.scrape.refresh_interval > 0
    assert 0 <= samples["inference_extension_metrics_scrape_cpu_share"].value < 0.5
    assert samples["inference_extension_metrics_scrape_steps_deferred_total"].value == 0


async def test_before_listen_runs_once_with_the_pool_in_and_no_port_open(tmp_path: Path) -> None:
    """``epp serve`` freezes its start-up heap here: after the pool loads, before ext_proc
    listens, so the collection that comes with it holds no request."""
    seen: list[tuple[int, int]] = []
    app_ref: list[Any] = []

    def before_listen() -> None:
        app = app_ref[0]
        seen.append((len(app.datastore.endpoints), app.ports.ext_proc))

    settings = make_settings(tmp_path, TEXT)
    app = App(settings, before_listen=before_listen)
    app_ref.append(app)
    await app.start()
    try:
        assert seen == [(1, 0)]  # one endpoint loaded, no ext_proc port yet
        assert app.ports.ext_proc > 0
    finally:
        await app.stop(drain_timeout=0.5)
