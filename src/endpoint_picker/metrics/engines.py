"""Which metric names each model-server engine exposes, and how settings override them.

An engine's names are a table of *fields* (the keys of ``ScrapeSettings.metric_overrides``):

=========================  =================================================================
field                      meaning (value: one or more metric specs, see below)
=========================  =================================================================
``queue``                  waiting requests, a gauge; summed over series (required)
``running``                running requests, a gauge; summed over series
``kv_usage``               KV-cache usage in [0, 1], a gauge; averaged over series (required)
``lora_info``              LoRA info gauge (labels ``max_lora``, ``running_lora_adapters``,
                           ``waiting_lora_adapters``; the series with the largest value wins)
``cache_info``             cache-config info gauge carrying block size / block count as labels
``cache_block_size_label`` the label of ``cache_info`` holding the block size (one label name)
``cache_num_blocks_label`` the label of ``cache_info`` holding the GPU block count
``block_size``             block size as a gauge's value (engines without ``cache_info``)
``num_gpu_blocks``         GPU block count as a gauge's value
``model_label``            the label of the ``queue`` series naming the served base model
                           (one label name; vLLM and SGLang write ``model_name``)
=========================  =================================================================

A *metric spec* is a metric name with optional label matchers, ``name`` or
``name{label="value",other=value}``. A field takes several specs separated by commas outside
braces; they are fallbacks, the first one present in a payload wins
(``vllm:kv_cache_usage_perc,vllm:gpu_cache_usage_perc``). An empty value disables the field
(label fields too).
An engine named only in the overrides starts from an empty table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import ScrapeSettings

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_MATCHER = re.compile(
    r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,"}]*?))\s*(?:,|\Z)'
)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """A metric name and the labels its series must carry to count."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()
    # The name as bytes: the parser searches raw payloads for it.
    needle: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _METRIC_NAME.match(self.name):
            raise ConfigError(f"invalid metric name {self.name!r}")
        object.__setattr__(self, "needle", self.name.encode())

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        inner = ",".join(f'{k}="{v}"' for k, v in self.labels)
        return f"{self.name}{{{inner}}}"


Specs = tuple[MetricSpec, ...]


@dataclass(frozen=True, slots=True)
class EngineMetricNames:
    """The metrics one engine is read from; each field lists fallbacks, first present wins."""

    queue: Specs = ()
    running: Specs = ()
    kv_usage: Specs = ()
    lora_info: Specs = ()
    cache_info: Specs = ()
    cache_block_size_label: str = "block_size"
    cache_num_blocks_label: str = "num_gpu_blocks"
    block_size: Specs = ()
    num_gpu_blocks: Specs = ()
    model_label: str = "model_name"
    # Every spec's name as bytes: the families a one-pass parse keeps.
    needles: frozenset[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = self.metric_names()
        object.__setattr__(self, "needles", frozenset(name.encode() for name in names))

    def metric_names(self) -> tuple[str, ...]:
        """Every metric name the fields read, each once, in field order: what a scrape asks
        the server for (``/metrics?name[]=...``)."""
        specs = (self.queue, self.running, self.kv_usage, self.lora_info, self.cache_info,
                 self.block_size, self.num_gpu_blocks)  # fmt: skip
        return tuple(dict.fromkeys(spec.name for field_specs in specs for spec in field_specs))


_LABEL_FIELDS = frozenset({"cache_block_size_label", "cache_num_blocks_label", "model_label"})
FIELDS = tuple(f.name for f in fields(EngineMetricNames) if f.init)  # what overrides may set


def parse_specs(text: str) -> Specs:
    """Parse ``name{l="v"},fallback`` into specs; raise ``ConfigError``."""
    specs: list[MetricSpec] = []
    for part in _split_top_level(text):
        name, brace, rest = part.partition("{")
        labels: tuple[tuple[str, str], ...] = ()
        if brace:
            if not rest.endswith("}"):
                raise ConfigError(f"unbalanced braces in metric spec {part!r}")
            labels = _parse_matchers(rest[:-1], part)
        specs.append(MetricSpec(name.strip(), labels))
    return tuple(specs)


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_matchers(body: str, spec: str) -> tuple[tuple[str, str], ...]:
    pairs, pos = [], 0
    body = body.strip()
    while pos < len(body):
        match = _MATCHER.match(body, pos)
        if match is None or match.end() == pos:
            raise ConfigError(f"invalid label matcher in metric spec {spec!r}")
        quoted, bare = match.group(2), match.group(3)
        value = quoted.replace('\\"', '"').replace("\\\\", "\\") if quoted is not None else bare
        pairs.append((match.group(1), value or ""))
        pos = match.end()
    return tuple(pairs)


def apply_overrides(
    base: EngineMetricNames, overrides: Mapping[str, str], *, engine: str
) -> EngineMetricNames:
    """Return ``base`` with the fields in ``overrides`` replaced; raise ``ConfigError``."""
    changes: dict[str, object] = {}
    for key, value in overrides.items():
        path = f"metric_overrides.{engine}.{key}"
        if key not in FIELDS:
            raise ConfigError(f"unknown field (expected one of {', '.join(FIELDS)})", path)
        try:
            if key in _LABEL_FIELDS:
                if value and not _LABEL_NAME.match(value):
                    raise ConfigError(f"invalid label name {value!r}")
                changes[key] = value
            else:
                changes[key] = parse_specs(value)
        except ConfigError as exc:
            raise ConfigError(str(exc), path) from exc
    return replace(base, **changes)  # type: ignore[arg-type]  # keys validated against FIELDS


def _table(**values: str) -> EngineMetricNames:
    return apply_overrides(EngineMetricNames(), values, engine="(built-in)")


BUILTIN_ENGINES: Mapping[str, EngineMetricNames] = {
    "vllm": _table(
        queue="vllm:num_requests_waiting",
        running="vllm:num_requests_running",
        # vLLM v0.10 renamed gpu_cache_usage_perc; older servers only have the old name.
        kv_usage="vllm:kv_cache_usage_perc,vllm:gpu_cache_usage_perc",
        lora_info="vllm:lora_requests_info",
        cache_info="vllm:cache_config_info",
    ),
    "sglang": _table(
        queue="sglang:num_queue_reqs",
        running="sglang:num_running_reqs",
        kv_usage="sglang:token_usage",
        cache_info="sglang:cache_config_info",
        cache_block_size_label="page_size",
        cache_num_blocks_label="num_pages",
    ),
    "trtllm-serve": _table(
        queue="trtllm_num_requests_waiting",
        running="trtllm_num_requests_running",
        kv_usage="trtllm_kv_cache_utilization",
        block_size="trtllm_kv_cache_tokens_per_block",
        num_gpu_blocks="trtllm_kv_cache_max_blocks",
    ),
}


def engine_names(settings: ScrapeSettings) -> dict[str, EngineMetricNames]:
    """The built-in engines merged with ``settings.metric_overrides``; raise ``ConfigError``."""
    tables = dict(BUILTIN_ENGINES)
    for engine, overrides in settings.metric_overrides.items():
        tables[engine] = apply_overrides(
            tables.get(engine, EngineMetricNames()), overrides, engine=engine
        )
    if settings.default_engine not in tables:
        raise ConfigError(
            f"unknown engine {settings.default_engine!r} (known: {', '.join(sorted(tables))})",
            "default_engine",
        )
    return tables
