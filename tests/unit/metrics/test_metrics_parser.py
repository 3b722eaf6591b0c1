"""The pure /metrics parser: realistic vLLM pages and the corners of the text format."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from tests.unit.metrics.metrics_builders import family, sglang_page, vllm_fixture, vllm_page

from endpoint_picker.metrics import parser
from endpoint_picker.metrics.engines import BUILTIN_ENGINES, parse_specs
from endpoint_picker.metrics.parser import MetricsParseError, parse_labels, parse_metrics
from endpoint_picker.types import MetricsSnapshot
from endpoint_picker_sim.metrics import restrict

VLLM = BUILTIN_ENGINES["vllm"]
W, R, KV = "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"
LORA, CACHE = "vllm:lora_requests_info", "vllm:cache_config_info"


def page(*families: str) -> bytes:
    return "".join(families).encode()


def base(queue: str = " 1", running: str = " 2", kv: str = " 0.5") -> list[str]:
    return [family(W, queue), family(R, running), family(KV, kv)]


def test_realistic_vllm_page() -> None:
    """A 64 KB vLLM v1 page with 2 DP engines: queues summed, KV averaged, LoRA and cache read."""
    snapshot = parse_metrics(vllm_fixture(), VLLM, now=12.5)
    assert snapshot == MetricsSnapshot(
        waiting_queue_size=7,
        running_requests=7,
        kv_cache_usage=0.5,
        active_adapters=frozenset({"sql-lora", "chat-lora"}),
        waiting_adapters=frozenset({"summarize"}),
        max_active_adapters=4,
        base_models=frozenset({"meta-llama/Llama-3.1-8B-Instruct"}),
        block_size=16,
        num_gpu_blocks=27153,
        updated_at=12.5,
    )


def test_filtered_vllm_page_reads_like_the_whole_page() -> None:
    """The page vLLM answers to ``/metrics?name[]=...`` (2 KB, read in one pass over its lines)
    gives the snapshot the whole 64 KB page (searched family by family) gives."""
    whole = vllm_fixture()
    filtered = restrict(whole.decode(), VLLM.metric_names()).encode()
    assert len(filtered) <= parser.SCAN_MAX_BYTES < len(whole)
    assert parse_metrics(filtered, VLLM, now=1.0) == parse_metrics(whole, VLLM, now=1.0)


CASES: list[tuple[str, bytes, dict[str, Any]]] = [
    ("no labels", page(*base()), {"waiting_queue_size": 1, "running_requests": 2}),
    (
        "labels in any order",
        page(
            family(W, '{model_name="m",engine="0"} 3', '{engine="1",model_name="m"} 4'), *base()[1:]
        ),
        {"waiting_queue_size": 7},
    ),
    (
        "escaped quotes, commas and braces in label values",
        page(family(W, r'{model_name="a\"b,c}d",x="\\"} 5'), *base()[1:]),
        {"waiting_queue_size": 5},
    ),
    (
        "exponent notation",
        page(*base(queue=" 1.5e+01", kv=" 2.5E-1")),
        {"waiting_queue_size": 15, "kv_cache_usage": 0.25},
    ),
    ("timestamp after the value", page(*base(queue=" 3 1712345678000")), {"waiting_queue_size": 3}),
    ("tabs between fields", page(*base(queue="\t6\t1712345678000")), {"waiting_queue_size": 6}),
    (
        "CRLF line endings",
        page(*base()).replace(b"\n", b"\r\n"),
        {"waiting_queue_size": 1, "kv_cache_usage": 0.5},
    ),
    ("no trailing newline", page(*base()).rstrip(b"\n"), {"kv_cache_usage": 0.5}),
    (
        "metric on the very first line",
        f"{W} 9\n".encode() + page(*base()[1:]),
        {"waiting_queue_size": 9},
    ),
    (
        "NaN and +Inf series are skipped",
        page(
            family(W, '{engine="0"} +Inf', '{engine="1"} 2'),
            family(R, " 1"),
            family(KV, '{engine="0"} NaN', '{engine="1"} 0.4'),
        ),
        {"waiting_queue_size": 2, "kv_cache_usage": 0.4},
    ),
    ("negative gauges read as zero", page(*base(queue=" -3")), {"waiting_queue_size": 0}),
    (
        "histograms and longer names sharing the prefix are not read",
        page(
            family(W + "_seconds", '_bucket{le="1.0"} 100', "_sum 7", "_count 9", kind="histogram"),
            family(W + "_by_priority", " 50"),
            *base(),
        ),
        {"waiting_queue_size": 1},
    ),
    (
        "data-parallel ranks: queues summed, KV averaged",
        page(
            family(W, '{engine="0"} 1', '{engine="1"} 2', '{engine="2"} 3'),
            family(R, '{engine="0"} 4', '{engine="1"} 5'),
            family(KV, '{engine="0"} 0.2', '{engine="1"} 0.6'),
        ),
        {"waiting_queue_size": 6, "running_requests": 9, "kv_cache_usage": pytest.approx(0.4)},
    ),
    (
        "older vLLM: gpu_cache_usage_perc is the fallback",
        page(family(W, " 1"), family(R, " 1"), family("vllm:gpu_cache_usage_perc", " 0.3")),
        {"kv_cache_usage": 0.3},
    ),
    ("running is optional", page(family(W, " 1"), family(KV, " 0.1")), {"running_requests": 0}),
    (
        "LoRA: the series with the largest timestamp wins, spaces trimmed",
        page(
            *base(),
            family(
                LORA,
                '{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.0e+09',
                '{max_lora="3",running_lora_adapters=" a , b,",waiting_lora_adapters="c"} 1.7e+09',
                '{max_lora="1",running_lora_adapters="mid",waiting_lora_adapters=""} 1.5e+09',
            ),
        ),
        {
            "active_adapters": frozenset({"a", "b"}),
            "waiting_adapters": frozenset({"c"}),
            "max_active_adapters": 3,
        },
    ),
    (
        "LoRA: empty lists",
        page(
            *base(),
            family(
                LORA, '{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7e+09'
            ),
        ),
        {"active_adapters": frozenset(), "max_active_adapters": 4},
    ),
    # No sample is not "no slots": a fresh vLLM pod reports LoRA info only once it schedules.
    ("LoRA absent", page(*base()), {"active_adapters": frozenset(), "max_active_adapters": None}),
    (
        "LoRA sample without max_lora reads as 0 slots",
        page(*base(), family(LORA, '{running_lora_adapters="a",waiting_lora_adapters=""} 1.0')),
        {"active_adapters": frozenset({"a"}), "max_active_adapters": 0},
    ),
    (
        "base models: every model_name of the queue series, escapes decoded",
        page(
            family(W, r'{engine="0",model_name="llama \"8B\""} 1', '{engine="1",model_name="q"} 1'),
            *base()[1:],
        ),
        {"base_models": frozenset({'llama "8B"', "q"})},
    ),
    ("base models: no labels, none known", page(*base()), {"base_models": frozenset()}),
    (
        "cache geometry; vLLM writes None for unset values",
        page(*base(), family(CACHE, '{block_size="32",engine="0",num_gpu_blocks="None"} 1.0')),
        {"block_size": 32, "num_gpu_blocks": None},
    ),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_parse_cases(text: bytes, expected: dict[str, Any]) -> None:
    """Each text-format corner case yields the expected snapshot fields."""
    snapshot = parse_metrics(text, VLLM, now=1.0)
    assert {key: getattr(snapshot, key) for key in expected} == expected
    assert snapshot.updated_at == 1.0


@pytest.mark.parametrize(
    ("text", "missing"),
    [
        (page(family(R, " 1"), family(KV, " 0.1")), W),
        (page(family(W, " 1"), family(R, " 1")), "vllm:gpu_cache_usage_perc"),
        (b"<html><body>Not Found</body></html>", W),
        (b"", W),
        (page(family(W + "_total", " 1", kind="counter"), family(KV, " 0.1")), W),
        (f"# HELP {W} x\n# TYPE {W} gauge\n{KV} 0.1\n".encode(), W),
    ],
    ids=["queue", "kv", "html", "empty", "only a longer name", "HELP/TYPE without samples"],
)
def test_missing_required_metric_raises(text: bytes, missing: str) -> None:
    """A page without a required metric raises instead of producing a snapshot of zeros."""
    with pytest.raises(MetricsParseError, match=missing):
        parse_metrics(text, VLLM, now=1.0)


def test_sglang_names_and_cache_labels() -> None:
    """SGLang's gauges are read, and its cache geometry from page_size / num_pages."""
    snapshot = parse_metrics(sglang_page(3, 4, 0.7), BUILTIN_ENGINES["sglang"], now=2.0)
    assert (snapshot.waiting_queue_size, snapshot.running_requests) == (3, 4)
    assert snapshot.kv_cache_usage == 0.7
    assert (snapshot.block_size, snapshot.num_gpu_blocks) == (64, 900)


def test_trtllm_cache_geometry_from_gauges() -> None:
    """trtllm-serve's block size and block count come from gauge values."""
    text = page(
        family("trtllm_num_requests_waiting", " 2"),
        family("trtllm_num_requests_running", " 1"),
        family("trtllm_kv_cache_utilization", " 0.9"),
        family("trtllm_kv_cache_tokens_per_block", " 32"),
        family("trtllm_kv_cache_max_blocks", " 4096"),
    )
    snapshot = parse_metrics(text, BUILTIN_ENGINES["trtllm-serve"], now=1.0)
    assert (snapshot.waiting_queue_size, snapshot.kv_cache_usage) == (2, 0.9)
    assert (snapshot.block_size, snapshot.num_gpu_blocks) == (32, 4096)


def test_label_matchers_select_series() -> None:
    """A spec with label matchers only counts the series that carry those labels."""
    names = replace(
        VLLM,
        queue=parse_specs('nv_requests{request_type="waiting"}'),
        running=parse_specs("nv_requests{request_type=running}"),
    )
    text = page(
        family(
            "nv_requests",
            '{model="x",request_type="waiting"} 5',
            '{request_type="running"} 2',
            '{request_type="waiting",model="y"} 1',
        ),
        family(KV, " 0.5"),
    )
    snapshot = parse_metrics(text, names, now=1.0)
    assert (snapshot.waiting_queue_size, snapshot.running_requests) == (6, 2)


def test_vllm_page_builder_round_trip() -> None:
    """The minimal page builder parses back to its inputs (the scraper tests rely on it)."""
    snapshot = parse_metrics(vllm_page(4, 5, 0.25), VLLM, now=3.0)
    assert (snapshot.waiting_queue_size, snapshot.running_requests) == (4, 5)
    assert math.isclose(snapshot.kv_cache_usage, 0.25)


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        (b'a="1",b="2"', {"a": "1", "b": "2"}),
        (b' a = "1" , b="x,y" ', {"a": "1", "b": "x,y"}),
        (
            rb'a="q\"uote",b="back\\slash",c="new\nline"',
            {"a": 'q"uote', "b": "back\\slash", "c": "new\nline"},
        ),
        (b'a="1",', {"a": "1"}),
        (b"", {}),
        (b'a="1",broken', {"a": "1"}),
    ],
    ids=["plain", "spaces and commas", "escapes", "trailing comma", "empty", "malformed tail"],
)
def test_parse_labels(block: bytes, expected: dict[str, str]) -> None:
    """Label blocks decode with escapes; a malformed tail is dropped, not fatal."""
    assert parse_labels(block) == expected


def test_hints_remember_each_family_and_follow_it() -> None:
    """The hints dict learns where each family starts; pages whose families moved a little,
    a lot, or out of the page parse exactly as without hints, and the hints follow."""
    fixture = vllm_fixture()
    hints: dict[bytes, int] = {}
    expected = parse_metrics(fixture, VLLM, now=1.0)
    assert parse_metrics(fixture, VLLM, now=1.0, hints=hints) == expected
    lora = LORA.encode()
    assert hints[lora] == fixture.index(b"\n" + lora + b"{") + 1
    for moved in (
        b"# a comment\n" + fixture,  # a little: within the window
        b"# padding\n" * 1000 + fixture,  # far: outside the window
        fixture.replace(b"\n" + lora, b"\nx_" + lora),  # gone
    ):
        assert parse_metrics(moved, VLLM, now=1.0, hints=hints) == parse_metrics(
            moved, VLLM, now=1.0
        )
    assert lora not in hints  # the last page had no LoRA family


def test_a_hint_inside_a_long_group_finds_the_group_start() -> None:
    """A hint that now points into the middle of a family's group (earlier lines grew) is not
    taken for its start: every sample of the family is still read."""
    engines = "".join(f'{W}{{engine="{i}",model_name="m"}} 1\n' for i in range(200))
    text = page(f"# TYPE {W} gauge\n" + engines, *base()[1:])
    hints = {W.encode(): text.index(b'engine="150"') - len(W) - 1}
    assert parse_metrics(text, VLLM, now=1.0, hints=hints).waiting_queue_size == 200
    assert hints[W.encode()] == text.index(W.encode() + b"{")


def test_a_hint_never_takes_a_later_segment_of_a_split_group() -> None:
    """A comment (or blank line) may split a family's group; a hint learned where the later
    segment started must not make the next page lose its earlier samples."""
    metadata = f"# HELP {W} waiting.\n# TYPE {W} gauge\n"
    comment = "# " + "x" * 3000 + "\n"  # longer than the hint window
    later = f'{W}{{engine="1"}} 5\n'
    first = page(metadata + comment + later, *base()[1:])
    second = page(metadata + f'{W}{{engine="0"}} 1\n' + comment + later, *base()[1:])
    hints: dict[bytes, int] = {}
    assert parse_metrics(first, VLLM, now=1.0, hints=hints).waiting_queue_size == 5
    for text in (second, second.replace(b"\n", b"\r\n")):
        expected = parse_metrics(text, VLLM, now=1.0)
        assert expected.waiting_queue_size == 1  # the group's first segment, as without hints
        assert parse_metrics(text, VLLM, now=1.0, hints=dict(hints)) == expected
