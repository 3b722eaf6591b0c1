"""One /metrics view over the parent and its workers."""

from __future__ import annotations

import prometheus_client

from endpoint_picker.telemetry.metrics import EppMetrics, PoolStats
from endpoint_picker.workers.merge import cumulative_only, merge_expositions, requests_counted

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]


def worker(requests: int) -> EppMetrics:
    metrics = EppMetrics(lambda: PoolStats("pool", 0.5, 2.0, 3))
    for _ in range(requests):
        metrics.request_started("m", "m", 100)
        metrics.request_finished(
            "m", "m", seconds=0.1, response_bytes=10, input_tokens=3, output_tokens=4
        )
    metrics.request_started("m", "m", 100)  # one still running
    return metrics


def samples(text: bytes) -> dict[str, float]:
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_counters_histograms_and_counting_gauges_are_summed() -> None:
    """Requests, durations (every bucket) and running requests add up across workers."""
    parent = EppMetrics(lambda: PoolStats("pool", 0.5, 2.0, 3)).render()
    merged = samples(merge_expositions(parent, [worker(2).render(), worker(3).render()]))
    labels = '{model_name="m",target_model_name="m"}'
    assert merged[f"inference_model_request_total{labels}"] == 7.0
    assert merged[f"inference_model_request_duration_seconds_count{labels}"] == 5.0
    bucket = "inference_model_request_duration_seconds_bucket{le=%s," + labels[1:]
    assert merged[bucket % '"0.025"'] == 0.0
    assert merged[bucket % '"0.2"'] == 5.0
    assert merged[bucket % '"+Inf"'] == 5.0
    assert merged['inference_model_running_requests{model_name="m"}'] == 2.0


def test_pool_and_process_families_come_from_the_parent_alone() -> None:
    """Pool gauges, pool reloads and process_* are the parent's, never multiplied."""
    parent_metrics = EppMetrics(lambda: PoolStats("pool", 0.5, 2.0, 3))
    parent_metrics.pool_reload("applied")
    parent = parent_metrics.render()
    merged = samples(merge_expositions(parent, [worker(1).render(), worker(1).render()]))
    assert merged['inference_pool_ready_pods{name="pool"}'] == 3.0
    assert merged['inference_extension_pool_reload_total{result="applied"}'] == 1.0
    assert merged["inference_extension_pool_source_healthy"] == 1.0
    assert merged["process_start_time_seconds"] == samples(parent)["process_start_time_seconds"]


def test_scraping_families_come_from_the_parent_alone() -> None:
    """The parent scrapes for every worker: its interval, CPU share and deferred steps are the
    view, whatever a worker's registry holds."""
    parent_metrics = EppMetrics(lambda: PoolStats("pool", 0.5, 2.0, 3))
    parent_metrics.track_scraping(lambda: 0.25, lambda: 0.4, lambda: 7.0)
    worker_metrics = worker(1)
    worker_metrics.track_scraping(lambda: 5.0, lambda: 0.9, lambda: 100.0)
    merged = samples(merge_expositions(parent_metrics.render(), [worker_metrics.render()] * 2))
    assert merged["inference_extension_metrics_refresh_interval_seconds"] == 0.25
    assert merged["inference_extension_metrics_scrape_cpu_share"] == 0.4
    assert merged["inference_extension_metrics_scrape_steps_deferred_total"] == 7.0


def test_merging_one_exposition_changes_nothing() -> None:
    """Names, labels, help, types and values survive the parse-and-render round trip."""
    text = worker(2).render()
    assert merge_expositions(text, []) == text


def test_requests_counted_sums_the_request_counter() -> None:
    """The per-worker balance reads inference_model_request_total of one exposition."""
    assert requests_counted(worker(4).render()) == 5.0


def test_a_dead_workers_counters_stay_in_the_sum_and_its_gauges_leave() -> None:
    """cumulative_only keeps counters and histograms only: merged with a replacement worker's
    fresh exposition, request totals never go down and running requests are the live ones."""
    parent = EppMetrics(lambda: PoolStats("pool", 0.5, 2.0, 3)).render()
    labels = '{model_name="m",target_model_name="m"}'
    before = samples(merge_expositions(parent, [worker(2).render(), worker(3).render()]))
    retired = cumulative_only(worker(3).render())
    assert "inference_model_running_requests" not in retired.decode()
    assert "inference_pool_" not in retired.decode()
    after = samples(merge_expositions(parent, [worker(2).render(), worker(0).render(), retired]))
    assert (
        after[f"inference_model_request_total{labels}"]
        == before[f"inference_model_request_total{labels}"] + 1
    )  # the replacement's one running request was counted when it started
    assert after['inference_model_running_requests{model_name="m"}'] == 2.0  # live workers only
