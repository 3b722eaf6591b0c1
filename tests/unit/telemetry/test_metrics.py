"""The EPP's metrics: bounded labels, reference error codes."""

from __future__ import annotations

import asyncio

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from endpoint_picker.errors import ErrorCode
from endpoint_picker.telemetry.metrics import MAX_MODEL_LABELS, OTHER_MODELS, EppMetrics


def families(metrics: EppMetrics) -> list[Metric]:
    return list(text_string_to_metric_families(metrics.render().decode()))


def samples_of(metrics: EppMetrics, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in families(metrics) for s in f.samples if s.name == name]


def error_samples(metrics: EppMetrics) -> dict[tuple[str, str], float]:
    text = metrics.render().decode()
    return {
        (s.labels["model_name"], s.labels["error_code"]): s.value
        for f in text_string_to_metric_families(text)
        if f.name == "inference_model_request_error"
        for s in f.samples
        if s.name.endswith("_total")
    }


def test_made_up_model_names_cannot_grow_metrics_without_bound() -> None:
    """Past MAX_MODEL_LABELS distinct routed names (or an overlong one) new names count as
    "other"."""
    metrics = EppMetrics()
    for i in range(MAX_MODEL_LABELS + 50):
        metrics.request_started(f"model-{i}", f"model-{i}", 10)
        metrics.request_failed(f"model-{i}", f"model-{i}", ErrorCode.SERVICE_UNAVAILABLE)
    metrics.request_started("x" * 1000, "x" * 1000, 10)
    metrics.request_failed("x" * 1000, "x" * 1000, ErrorCode.SERVICE_UNAVAILABLE)
    samples = error_samples(metrics)
    assert len({model for model, _ in samples}) == MAX_MODEL_LABELS + 1
    assert samples[(OTHER_MODELS, "ServiceUnavailable")] == 51.0


def test_a_refused_unknown_model_never_becomes_a_series() -> None:
    """2,000 requests for distinct unknown names the EPP refuses (404, 400, 503) all count as
    "other": no label is minted for them, and the budget stays whole for routed names."""
    metrics = EppMetrics()
    for i in range(2000):
        code = (ErrorCode.NOT_FOUND, ErrorCode.BAD_REQUEST, ErrorCode.SERVICE_UNAVAILABLE)[i % 3]
        metrics.request_failed(f"junk-{i}", f"junk-{i}", code)
    assert {model for model, _ in error_samples(metrics)} == {OTHER_MODELS}
    assert "junk-" not in metrics.render().decode()
    metrics.request_started("routed-later", "routed-later", 10)
    totals = samples_of(metrics, "inference_model_request_total")
    assert totals == [({"model_name": "routed-later", "target_model_name": "routed-later"}, 1.0)]


def test_configured_models_keep_their_label_after_the_budget_is_spent() -> None:
    """Names the pool configures are labelled as themselves however many junk names came first."""
    configured = {"late-model", "late-model-v2"}
    metrics = EppMetrics(is_configured_model=configured.__contains__)
    for i in range(MAX_MODEL_LABELS + 100):
        metrics.request_failed(f"junk-{i}", f"junk-{i}", ErrorCode.NOT_FOUND)
    metrics.request_started("late-model", "late-model-v2", 10)
    metrics.request_failed("late-model", "late-model-v2", ErrorCode.SERVICE_UNAVAILABLE)
    assert error_samples(metrics)[("late-model", "ServiceUnavailable")] == 1.0
    totals = samples_of(metrics, "inference_model_request_total")
    assert totals == [({"model_name": "late-model", "target_model_name": "late-model-v2"}, 1.0)]


def test_invalid_usage_is_counted_not_observed() -> None:
    """A response flagged with invalid usage bumps the counter and leaves the token histograms."""
    metrics = EppMetrics()
    metrics.request_started("m", "m", 10)
    metrics.request_finished(
        "m", "m", seconds=0.1, response_bytes=5, input_tokens=None, output_tokens=None,
        invalid_usage=True,
    )  # fmt: skip
    labels = {"model_name": "m", "target_model_name": "m"}
    invalid = samples_of(metrics, "inference_extension_model_server_invalid_usage_total")
    assert invalid == [(labels, 1.0)]
    assert samples_of(metrics, "inference_model_input_tokens_count") == []


def test_process_metrics_are_exported() -> None:
    """The standard process_* families (memory, open fds) are on the EPP's own registry."""
    names = {s.name for f in families(EppMetrics()) for s in f.samples}
    assert {"process_resident_memory_bytes", "process_open_fds", "python_info"} <= names


def test_error_codes_use_the_reference_names() -> None:
    """Error kinds are labelled as the reference EPP labels them."""
    metrics = EppMetrics(is_configured_model={"m"}.__contains__)
    for code in ErrorCode:
        metrics.request_failed("m", "m", code)
    codes = {code for (_, code) in error_samples(metrics)}
    assert codes == {
        "BadRequest",
        "BadConfiguration",
        "InferencePoolResourceExhausted",
        "ServiceUnavailable",
        "Internal",
    }


async def test_event_loop_tasks_counts_the_running_loops_tasks() -> None:
    """The gauge reads the live task count of the loop /metrics is rendered on."""

    def loop_tasks() -> float:
        [(_, value)] = samples_of(metrics, "inference_extension_event_loop_tasks")
        return value

    metrics = EppMetrics()
    before = loop_tasks()
    release = asyncio.Event()
    waiters = [asyncio.create_task(release.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    assert loop_tasks() == before + 3
    release.set()
    await asyncio.gather(*waiters)
    assert loop_tasks() == before


def test_event_loop_tasks_is_zero_off_the_loop() -> None:
    """Rendered where no event loop runs, the gauge reads 0 instead of failing the page."""
    assert samples_of(EppMetrics(), "inference_extension_event_loop_tasks") == [({}, 0.0)]
