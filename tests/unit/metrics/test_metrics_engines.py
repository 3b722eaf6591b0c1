"""Engine metric-name tables: built-ins, spec parsing, overrides from settings."""

from __future__ import annotations

import pytest

from endpoint_picker.errors import ConfigError
from endpoint_picker.metrics.engines import (
    BUILTIN_ENGINES,
    EngineMetricNames,
    MetricSpec,
    engine_names,
    parse_specs,
)
from endpoint_picker.metrics.parser import parse_metrics
from endpoint_picker.settings import ScrapeSettings


def names(specs: tuple[MetricSpec, ...]) -> list[str]:
    return [str(spec) for spec in specs]


@pytest.mark.parametrize(
    ("engine", "queue", "running", "kv_usage"),
    [
        ("vllm", "vllm:num_requests_waiting", "vllm:num_requests_running",
         ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]),
        ("sglang", "sglang:num_queue_reqs", "sglang:num_running_reqs", ["sglang:token_usage"]),
        ("trtllm-serve", "trtllm_num_requests_waiting", "trtllm_num_requests_running",
         ["trtllm_kv_cache_utilization"]),
    ],
)  # fmt: skip
def test_builtin_engines(engine: str, queue: str, running: str, kv_usage: list[str]) -> None:
    """Each built-in engine reads its server's documented metric names."""
    table = BUILTIN_ENGINES[engine]
    assert names(table.queue) == [queue]
    assert names(table.running) == [running]
    assert names(table.kv_usage) == kv_usage


def test_vllm_lora_and_cache_names() -> None:
    """vLLM's LoRA and cache-config info gauges and their label names are the defaults."""
    table = BUILTIN_ENGINES["vllm"]
    assert names(table.lora_info) == ["vllm:lora_requests_info"]
    assert names(table.cache_info) == ["vllm:cache_config_info"]
    assert (table.cache_block_size_label, table.cache_num_blocks_label) == (
        "block_size",
        "num_gpu_blocks",
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a", [MetricSpec("a")]),
        ("a , b:c", [MetricSpec("a"), MetricSpec("b:c")]),
        ('m{t="waiting"}', [MetricSpec("m", (("t", "waiting"),))]),
        ("m{t=waiting,u=x},n", [MetricSpec("m", (("t", "waiting"), ("u", "x"))), MetricSpec("n")]),
        ('m{t="a,b}"}', [MetricSpec("m", (("t", "a,b}"),))]),
        (r'm{t="q\"x"}', [MetricSpec("m", (("t", 'q"x'),))]),
        ("", []),
    ],
    ids=[
        "one",
        "fallbacks",
        "quoted matcher",
        "bare matchers",
        "comma in value",
        "escape",
        "empty",
    ],
)
def test_parse_specs(text: str, expected: list[MetricSpec]) -> None:
    """Specs parse into names, label matchers and fallbacks split at top-level commas."""
    assert list(parse_specs(text)) == expected


@pytest.mark.parametrize("text", ["9bad", "a b", "m{t=", "m{=x}", "m{t x}"])
def test_parse_specs_rejects(text: str) -> None:
    """Malformed names and matchers are configuration errors."""
    with pytest.raises(ConfigError):
        parse_specs(text)


def settings(**overrides: dict[str, str]) -> ScrapeSettings:
    return ScrapeSettings(metric_overrides=overrides)


def test_overrides_replace_only_named_fields() -> None:
    """An override replaces one field of a built-in engine and leaves the rest."""
    tables = engine_names(settings(vllm={"queue": "my_queue", "kv_usage": "a,b"}))
    assert names(tables["vllm"].queue) == ["my_queue"]
    assert names(tables["vllm"].kv_usage) == ["a", "b"]
    assert tables["vllm"].running == BUILTIN_ENGINES["vllm"].running
    assert tables["sglang"] == BUILTIN_ENGINES["sglang"]


def test_empty_override_disables_a_field() -> None:
    """An empty value turns a field off (here: no LoRA metrics are read)."""
    assert engine_names(settings(vllm={"lora_info": ""}))["vllm"].lora_info == ()


def test_model_label_defaults_to_model_name_and_can_be_renamed_or_disabled() -> None:
    """Base models are read from ``model_name``; an override renames it, an empty one disables."""
    page = b'q{model_name="a",served="b"} 1\nkv 0.1\n'
    base = {"queue": "q", "kv_usage": "kv"}
    tables = engine_names(
        settings(x=base, y={**base, "model_label": "served"}, z={**base, "model_label": ""})
    )
    assert [parse_metrics(page, tables[e], now=1.0).base_models for e in "xyz"] == [
        frozenset({"a"}),
        frozenset({"b"}),
        frozenset(),
    ]


def test_new_engine_starts_empty() -> None:
    """An engine known only from overrides has exactly the fields it names."""
    table = engine_names(settings(tgi={"queue": "tgi_queue_size", "cache_block_size_label": "bs"}))
    assert table["tgi"] == EngineMetricNames(
        queue=(MetricSpec("tgi_queue_size"),), cache_block_size_label="bs"
    )


@pytest.mark.parametrize(
    ("overrides", "path"),
    [
        ({"vllm": {"queues": "x"}}, "metric_overrides.vllm.queues"),
        ({"vllm": {"queue": "1x"}}, "metric_overrides.vllm.queue"),
        ({"x": {"cache_num_blocks_label": "a-b"}}, "metric_overrides.x.cache_num_blocks_label"),
        ({"vllm": {"needles": "x"}}, "metric_overrides.vllm.needles"),  # derived, not a field
    ],
    ids=["unknown field", "bad metric name", "bad label name", "derived attribute"],
)
def test_bad_overrides_name_their_path(overrides: dict[str, dict[str, str]], path: str) -> None:
    """A bad override is a ConfigError that names the field at fault."""
    with pytest.raises(ConfigError) as info:
        engine_names(ScrapeSettings(metric_overrides=overrides))
    assert info.value.path == path


def test_unknown_default_engine_is_rejected() -> None:
    """A default engine with no table is a ConfigError at start-up, not a scrape-time surprise."""
    with pytest.raises(ConfigError, match="unknown engine 'tgi'"):
        engine_names(ScrapeSettings(default_engine="tgi"))
