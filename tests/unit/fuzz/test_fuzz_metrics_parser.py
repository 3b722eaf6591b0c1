"""Property-based fuzzing of the /metrics parser against prometheus_client's own parser."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from unittest.mock import patch

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from endpoint_picker.metrics import parser
from endpoint_picker.metrics.engines import (
    BUILTIN_ENGINES,
    EngineMetricNames,
    Specs,
    parse_specs,
)
from endpoint_picker.metrics.parser import MetricsParseError, parse_labels, parse_metrics
from endpoint_picker.types import MetricsSnapshot

# What the EPP reads: the built-in engines, and one with label matchers and fallbacks.
ENGINES = {
    **BUILTIN_ENGINES,
    "matchers": EngineMetricNames(
        queue=parse_specs('vllm:num_requests_waiting{engine="0"},sglang:num_queue_reqs'),
        running=parse_specs('vllm:num_requests_running{model_name="m"}'),
        kv_usage=parse_specs("vllm:kv_cache_usage_perc,vllm:gpu_cache_usage_perc"),
        lora_info=parse_specs("vllm:lora_requests_info"),
        cache_info=parse_specs('vllm:cache_config_info{engine="1"}'),
        block_size=parse_specs("trtllm_kv_cache_tokens_per_block"),
        num_gpu_blocks=parse_specs("trtllm_kv_cache_max_blocks"),
    ),
}


def _read_specs(names: EngineMetricNames) -> Specs:
    return (*names.queue, *names.running, *names.kv_usage, *names.lora_info, *names.cache_info,
            *names.block_size, *names.num_gpu_blocks)  # fmt: skip


READ_NAMES = sorted({spec.name for names in ENGINES.values() for spec in _read_specs(names)})
# Names that contain a read name or are contained in one: the parser must tell them apart.
NOISE_NAMES = [
    "vllm:num_requests",
    "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc2",
    "vllm:time_to_first_token_seconds",
    "process_cpu_seconds",
    "sglang:num_queue_reqs_x",
]
LABEL_NAMES = st.sampled_from(
    [
        "engine",
        "model_name",
        "max_lora",
        "running_lora_adapters",
        "waiting_lora_adapters",
        "block_size",
        "num_gpu_blocks",
        "page_size",
        "num_pages",
        "le_x",
        "_x",
        "a1",
    ]
)
# Label values: the EPP's own values (engine ids, adapter lists, integers) and text full of
# the characters the format escapes, or that close label blocks if read naively.
LABEL_VALUES = st.sampled_from(
    ["0", "1", "m", "16", "27153", "None", "-4", "1e3", "a,b", " x , y ,", "", "1.5", "inf"]
) | st.text(alphabet=st.sampled_from('ab"\\\n{},= \té'), max_size=8)
# Sample values in the forms Prometheus writes, NaN and the infinities among them.
VALUES = (
    st.floats(allow_nan=True, allow_infinity=True).map(repr)
    | st.integers(-(10**20), 10**20).map(str)
    | st.sampled_from(
        ["NaN", "+Inf", "-Inf", "0", "-0", "1e308", "-1e308", "1.7976931348623157e308"]
    )
)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # gauge, untyped, counter, histogram
    series: tuple[tuple[tuple[tuple[str, str], ...], str, int | None], ...]  # labels, value, ts


@st.composite
def families(draw: st.DrawFn, values: st.SearchStrategy[str], noise: bool) -> Family:
    """One family: a name the EPP reads (or, with ``noise``, one close to such a name), of
    any type (a counter or histogram named after a read family writes other sample names)."""
    name = draw(st.sampled_from(READ_NAMES + NOISE_NAMES if noise else READ_NAMES))
    kind = draw(st.sampled_from(["gauge", "gauge", "untyped", "counter", "histogram"]))
    labels = st.dictionaries(LABEL_NAMES, LABEL_VALUES, max_size=4).map(lambda d: tuple(d.items()))
    timestamps = st.none() | st.integers(0, 2**53)
    series = draw(st.lists(st.tuples(labels, values, timestamps), min_size=1, max_size=4))
    return Family(name, kind, tuple(series))


def sample_line(
    name: str, labels: tuple[tuple[str, str], ...], value: str, ts: str, spaced: bool
) -> str:
    block = (", " if spaced else ",").join(f'{k}="{escape(v)}"' for k, v in labels)
    return f"{name}{{{block}}} {value}{ts}" if labels else f"{name} {value}{ts}"


@st.composite
def pages(draw: st.DrawFn, values: st.SearchStrategy[str] = VALUES, noise: bool = True) -> str:
    """Exposition text as servers write it: HELP and TYPE lines, then the family's samples."""
    chosen = draw(st.lists(families(values, noise), max_size=8, unique_by=lambda f: f.name))
    spaced = draw(st.booleans())  # "a="1", b="2"": prometheus_client's own parser allows it
    lines: list[str] = []
    for family in chosen:
        help_text = draw(st.text(alphabet=st.sampled_from('ab \\"\n'), max_size=6))
        help_text = help_text.replace("\\", "\\\\").replace("\n", "\\n")
        lines += [f"# HELP {family.name} {help_text}", f"# TYPE {family.name} {family.kind}"]
        for labels, value, timestamp in family.series:
            ts = "" if timestamp is None else f" {timestamp}"
            if family.kind == "counter":
                lines.append(sample_line(f"{family.name}_total", labels, value, ts, spaced))
            elif family.kind == "histogram":
                pairs = tuple(p for p in labels if p[0] != "le")
                bucket = (*pairs, ("le", "+Inf"))
                lines.append(sample_line(f"{family.name}_bucket", bucket, "1", ts, spaced))
                lines.append(sample_line(f"{family.name}_sum", pairs, value, ts, spaced))
                lines.append(sample_line(f"{family.name}_count", pairs, "1", ts, spaced))
            else:
                lines.append(sample_line(family.name, labels, value, ts, spaced))
    return "\n".join(lines) + ("\n" if lines and draw(st.booleans()) else "")


Sample = tuple[dict[str, str], float]


def reference_samples(text: str) -> dict[str, list[Sample]]:
    """Every sample prometheus_client reads, by sample name, in page order."""
    by_name: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            by_name.setdefault(s.name, []).append((s.labels, float(s.value)))
    return by_name


def reference_snapshot(text: str, names: EngineMetricNames, now: float) -> MetricsSnapshot | None:
    """The snapshot the parser's documented rules give over prometheus_client's samples;
    None when a required metric is missing."""
    samples = reference_samples(text)

    def first_present(specs: Specs) -> list[Sample] | None:
        for spec in specs:
            found = samples.get(spec.name)
            if found is not None:
                wanted = dict(spec.labels)
                return [
                    (labels, value)
                    for labels, value in found
                    if math.isfinite(value) and all(labels.get(k) == v for k, v in wanted.items())
                ]
        return None

    def count(found: list[Sample] | None) -> int:
        return round(clamp(sum(value for _, value in found or ())))

    def positive_int(text: str | None) -> int | None:
        try:
            value = int(float(text)) if text else None
        except (ValueError, OverflowError):
            return None
        return value if value is not None and value > 0 else None

    queue, kv = first_present(names.queue), first_present(names.kv_usage)
    if (names.queue and queue is None) or (names.kv_usage and kv is None):
        return None
    kv_values = [value for _, value in kv or ()]
    lora = first_present(names.lora_info)
    active = waiting = frozenset[str]()
    max_lora = None
    if lora:
        labels = max(lora, key=lambda s: s[1])[0]

        def adapters(key: str) -> frozenset[str]:
            return frozenset(a.strip() for a in labels.get(key, "").split(",") if a.strip())

        active, waiting = adapters("running_lora_adapters"), adapters("waiting_lora_adapters")
        max_lora = positive_int(labels.get("max_lora")) or 0
    block_size = num_blocks = None
    info = first_present(names.cache_info)
    if info:
        block_size = positive_int(info[0][0].get(names.cache_block_size_label))
        num_blocks = positive_int(info[0][0].get(names.cache_num_blocks_label))
    if block_size is None and (found := first_present(names.block_size)):
        block_size = round(found[0][1])
    if num_blocks is None and (found := first_present(names.num_gpu_blocks)):
        num_blocks = round(found[0][1])
    model_label = names.model_label
    return MetricsSnapshot(
        waiting_queue_size=count(queue),
        running_requests=count(first_present(names.running)),
        kv_cache_usage=clamp(sum(kv_values) / len(kv_values)) if kv_values else 0.0,
        active_adapters=active,
        waiting_adapters=waiting,
        max_active_adapters=max_lora,
        base_models=frozenset(
            v for labels, _ in queue or () if model_label and (v := labels.get(model_label, ""))
        ),
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        updated_at=now,
    )


def clamp(value: float) -> float:
    return max(0.0, min(value, sys.float_info.max))


def agrees(text: str, engine: str) -> None:
    names = ENGINES[engine]
    expected = reference_snapshot(text, names, now=1.0)
    if expected is None:
        try:
            parse_metrics(text.encode(), names, now=1.0)
        except MetricsParseError:
            return
        raise AssertionError("a page without a required metric must raise MetricsParseError")
    assert parse_metrics(text.encode(), names, now=1.0) == expected


@given(pages(), st.sampled_from(sorted(ENGINES)))
def test_agrees_with_prometheus_client(text: str, engine: str) -> None:
    """Well-formed pages give the snapshot prometheus_client's samples give by the rules."""
    # the rules: sums, mean, LoRA max, first cache series; and a MetricsParseError exactly when
    # a required family is absent
    agrees(text, engine)


@given(pages(), pages(), st.sampled_from(sorted(ENGINES)))
def test_hints_from_another_page_change_nothing(first: str, second: str, engine: str) -> None:
    """Offsets remembered from one page (however different) never change the next page's
    snapshot: a stale hint falls back to a whole-page search."""
    names = ENGINES[engine]
    hints: dict[bytes, int] = {}
    for text in (first, second, second):
        try:
            expected = parse_metrics(text.encode(), names, now=1.0)
        except MetricsParseError:
            with pytest.raises(MetricsParseError):
                parse_metrics(text.encode(), names, now=1.0, hints=hints)
            continue
        assert parse_metrics(text.encode(), names, now=1.0, hints=hints) == expected


EXTREMES = st.sampled_from(["1e308", "1.7976931348623157e308", "-1e308", "NaN", "+Inf", "5e-324"])


@given(pages(EXTREMES, noise=False), st.sampled_from(sorted(ENGINES)))
def test_extreme_values(text: str, engine: str) -> None:
    """Values at the float limits still agree, and every count and usage stays finite."""
    agrees(text, engine)
    check_snapshot(text.encode(), ENGINES[engine])


@given(st.dictionaries(LABEL_NAMES, LABEL_VALUES, max_size=5), st.booleans())
def test_labels_agree_with_prometheus_client(labels: dict[str, str], spaced: bool) -> None:
    """A label block decodes (escapes included) to what prometheus_client reads."""
    block = (", " if spaced else ",").join(f'{k}="{escape(v)}"' for k, v in labels.items())
    (family,) = text_string_to_metric_families(f"x{{{block}}} 1\n")
    assert parse_labels(block.encode()) == family.samples[0].labels == labels


def check_snapshot(text: bytes, names: EngineMetricNames) -> None:
    """Parse ``text``: a sane snapshot or a MetricsParseError, nothing else."""
    try:
        snapshot = parse_metrics(text, names, now=1.0)
    except MetricsParseError:
        return
    assert snapshot.waiting_queue_size >= 0
    assert snapshot.running_requests >= 0
    assert math.isfinite(snapshot.kv_cache_usage)
    assert snapshot.kv_cache_usage >= 0
    assert snapshot.max_active_adapters is None or snapshot.max_active_adapters >= 0


GARBAGE_ATOMS = st.sampled_from(
    [
        *READ_NAMES,
        *NOISE_NAMES,
        "{",
        "}",
        '"',
        "\\",
        "=",
        ",",
        " ",
        "\t",
        "\n",
        "\r\n",
        "# ",
        "# TYPE ",
        "NaN",
        "+Inf",
        "1e308",
        "-1e308",
        "1",
        "0.5",
        'engine="0"',
        "max_lora=",
        "\x00",
        "\xff",
        "é",
    ]
)


@given(st.lists(GARBAGE_ATOMS | st.text(max_size=4), max_size=40), st.sampled_from(sorted(ENGINES)))
def test_garbage_text(atoms: list[str], engine: str) -> None:
    """Metric-like garbage gives a sane snapshot or a MetricsParseError, nothing else."""
    check_snapshot("".join(atoms).encode(), ENGINES[engine])


def parse_both_ways(text: bytes, names: EngineMetricNames) -> list[MetricsSnapshot | str]:
    """The outcome (a snapshot, or the error's message) of the one-pass reading and of the
    search, whatever the page's size."""
    outcomes: list[MetricsSnapshot | str] = []
    for scan_max in (len(text), len(text) - 1):  # scanned, then searched
        with patch.object(parser, "SCAN_MAX_BYTES", scan_max):
            try:
                outcomes.append(parse_metrics(text, names, now=1.0))
            except MetricsParseError as exc:
                outcomes.append(str(exc))
    return outcomes


# Lines that start, continue, split and end families' groups (a read family may come back
# after another one, a comment or a blank line: only its first group counts).
LINE_FORMS = st.sampled_from(
    [
        "{name} {value}",
        '{name}{{engine="{value}",model_name="m"}} {value}',
        "{name}\t{value} 1700000000",
        '{name}{{x="}}"}}',  # no value: malformed, but the group goes on
        "{name}",  # a name alone: no sample line
        '{name}_bucket{{le="1"}} {value}',
        "# TYPE {name} gauge",
        "",
        " {name} {value}",
    ]
)
LINES = st.builds(
    str.format,
    LINE_FORMS,
    name=st.sampled_from(
        ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:num_requests"]
    ),
    value=st.integers(0, 9).map(str),
)


@given(
    pages() | st.lists(GARBAGE_ATOMS | st.text(max_size=4), max_size=40).map("".join),
    st.sampled_from(sorted(ENGINES)),
)
def test_one_pass_and_search_read_the_same(text: str, engine: str) -> None:
    """A page read in one pass over its lines (small pages) and by searching each family
    (large ones) gives the same snapshot or the same error, well-formed or garbage."""
    scanned, searched = parse_both_ways(text.encode(), ENGINES[engine])
    assert scanned == searched


@given(st.lists(LINES, max_size=30), st.sampled_from(["\n", "\r\n"]))
def test_one_pass_and_search_take_the_same_groups(lines: list[str], newline: str) -> None:
    """Families split by other families, comments, blank or malformed lines: both readings
    take each family's first group, whole."""
    required = ["vllm:num_requests_waiting 0", "vllm:kv_cache_usage_perc 0"]  # unless earlier
    text = newline.join(lines + required)
    scanned, searched = parse_both_ways(text.encode(), ENGINES["vllm"])
    assert scanned == searched


@given(st.binary(max_size=300), st.sampled_from(sorted(ENGINES)))
def test_arbitrary_bytes(data: bytes, engine: str) -> None:
    """Arbitrary bytes (invalid UTF-8 too): a snapshot or a MetricsParseError, nothing else."""
    check_snapshot(data, ENGINES[engine])


def test_finite_samples_summing_past_the_largest_float() -> None:
    """Regression: finite samples summing past the largest float are clamped, not inf."""
    # two queue samples of 1e308 raised OverflowError (round(inf)); two KV samples gave inf
    page = (
        'vllm:num_requests_waiting{engine="0"} 1e308\n'
        'vllm:num_requests_waiting{engine="1"} 1e308\n'
        'vllm:kv_cache_usage_perc{engine="0"} 1e308\n'
        'vllm:kv_cache_usage_perc{engine="1"} 1e308\n'
    )
    snapshot = parse_metrics(page.encode(), BUILTIN_ENGINES["vllm"], now=1.0)
    assert snapshot.waiting_queue_size == round(sys.float_info.max)
    assert snapshot.kv_cache_usage == sys.float_info.max
