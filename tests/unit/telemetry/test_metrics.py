"""The EPP's metrics: bounded labels, reference error codes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from endpoint_picker.errors import ErrorCode
from endpoint_picker.telemetry.metrics import MAX_MODEL_LABELS, OTHER_MODELS, EppMetrics


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
    """Past MAX_MODEL_LABELS distinct names (or an overlong one) new names count as "other"."""
    metrics = EppMetrics()
    for i in range(MAX_MODEL_LABELS + 50):
        metrics.request_failed(f"model-{i}", f"model-{i}", ErrorCode.NOT_FOUND)
    metrics.request_failed("x" * 1000, "", ErrorCode.NOT_FOUND)
    samples = error_samples(metrics)
    assert len({model for model, _ in samples}) == MAX_MODEL_LABELS + 1
    assert samples[(OTHER_MODELS, "BadConfiguration")] == 51.0


def test_error_codes_use_the_reference_names() -> None:
    """Error kinds are labelled as the reference EPP labels them."""
    metrics = EppMetrics()
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
