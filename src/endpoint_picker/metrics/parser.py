"""Parse a model server's Prometheus text into a ``MetricsSnapshot``: a pure function.

Speed is the point. vLLM's ``/metrics`` is tens of KB, mostly histogram buckets, and it is read
20 times a second per pod, while a snapshot needs a handful of gauges. So the payload is never
split into lines: each wanted family is found with ``bytes.find`` (``"\\n" + name``, then a check
that the name ends there, which skips ``name_bucket`` and the ``# HELP``/``# TYPE`` lines), and only
its own lines are decoded. The exposition format keeps a family's samples in one group, so reading
stops at the first line that belongs to another family.

A server writes its page in the same order every time, so a family starts near where it
started on the previous page. ``hints`` (one dict per endpoint, kept by the caller) remembers
each family's offset, and the next parse looks within ``_HINT_WINDOW`` bytes of it first: a hit
is taken only where the line before is the family's own ``# TYPE`` or ``# HELP`` line (so it is
the group's first line: a comment or blank line may split a group, and only one such line
heads it on a well-formed page), otherwise the whole page is searched. On vLLM's page the
LoRA and cache-config families come last, and two full searches for them were most of a parse.

A page of at most ``SCAN_MAX_BYTES`` is read in one pass over its lines instead: what a server
that honours ``/metrics?name[]=...`` answers (vLLM's, about 2 KB, the scraper's default request)
has a couple of lines per family, and five searches with their bookkeeping cost more than one
pass. Both readings take the same lines: a family's first group, up to its first line that is
a comment, blank, without a name followed by ``{``, a space or a tab, or of another family
(malformed lines within the group are skipped, not an end). With hints, that holds on a
well-formed page (each family in one group).

Aggregation across series (data-parallel ranks differ by an ``engine`` label; any other labels,
in any order, are ignored unless a spec matches on them): queues and running requests are
summed, KV usage is averaged, the LoRA series with the largest value (a timestamp) wins, cache
geometry comes from the first series, the base models are every value of the queue series'
model label. Non-finite values (``NaN``, ``+Inf``) are skipped, and a sum or mean of finite
values is clamped to [0, the largest float] (two samples of ``1e308`` overflow to infinity).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from functools import lru_cache

from endpoint_picker.errors import EppError
from endpoint_picker.metrics.engines import EngineMetricNames, MetricSpec, Specs
from endpoint_picker.types import MetricsSnapshot

_BOUNDARY = frozenset(b"{ \t")
SCAN_MAX_BYTES = 8192  # pages up to this size are read in one pass over their lines
# A sample line's metric name: what comes before its first brace, space or tab.
_SAMPLE_NAME = re.compile(rb"[^{ \t]*+(?=[{ \t])")
_HINT_WINDOW = 2048  # bytes either side of a family's previous offset
_MAX_FLOAT = sys.float_info.max
# One label pair; values may hold escaped quotes, commas and braces.
_LABEL = re.compile(rb'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPES = re.compile(rb"\\(.)")
_UNESCAPE = {b"n": b"\n", b"\\": b"\\", b'"': b'"'}

Labels = dict[str, str]
Sample = tuple[bytes, float]  # (raw label block without braces, value)


class MetricsParseError(EppError):
    """A payload lacks a required metric or is not Prometheus text."""


Hints = dict[bytes, int]  # a family's needle -> where its first sample line was last time
Family = Callable[[bytes], list[Sample] | None]  # a family's samples by needle; None if absent


def parse_metrics(
    text: bytes, names: EngineMetricNames, now: float, hints: Hints | None = None
) -> MetricsSnapshot:
    """Read the snapshot ``names`` describes out of ``text``, stamped ``now``.

    ``hints``, when given, is read and updated: pass the same dict for every page of one
    server (the result is the same with or without it, on any well-formed page).
    Raises ``MetricsParseError`` when a configured required metric (``queue``, ``kv_usage``) is
    absent, so that a wrong page never replaces a good snapshot with zeros.
    """
    family: Family
    if len(text) <= SCAN_MAX_BYTES:
        family = _scan(text, names.needles).get
    else:

        def family(needle: bytes) -> list[Sample] | None:
            return _search(text, needle, hints)

    queue = _first_present(family, names.queue)
    kv_usage = _first_present(family, names.kv_usage)
    missing = [
        " or ".join(map(str, specs))
        for specs, samples in ((names.queue, queue), (names.kv_usage, kv_usage))
        if specs and samples is None
    ]
    if missing:
        raise MetricsParseError(f"missing metrics: {'; '.join(missing)}")

    running = _first_present(family, names.running)
    kv_values = [value for _, value in kv_usage or ()]
    active, waiting, max_lora = _lora(_first_present(family, names.lora_info))
    base_models = _label_values(queue, names.model_label) if names.model_label else frozenset()
    block_size, num_blocks = _cache_geometry(family, names)
    return MetricsSnapshot(
        waiting_queue_size=_count(queue),
        running_requests=_count(running),
        kv_cache_usage=_clamp(sum(kv_values) / len(kv_values)) if kv_values else 0.0,
        active_adapters=active,
        waiting_adapters=waiting,
        max_active_adapters=max_lora,
        base_models=base_models,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        updated_at=now,
    )


def _count(samples: list[Sample] | None) -> int:
    return round(_clamp(sum(value for _, value in samples))) if samples else 0


def _clamp(value: float) -> float:
    """``value`` within [0, the largest float]: finite samples can still sum to infinity."""
    return max(0.0, min(value, _MAX_FLOAT))


def _first_present(family: Family, specs: Specs) -> list[Sample] | None:
    """The samples of the first spec whose family is in the page (those its label matchers
    take); ``None`` if none is."""
    for spec in specs:
        samples = family(spec.needle)
        if samples is not None:
            if not spec.labels:
                return samples
            return [sample for sample in samples if _matches(sample[0], spec)]
    return None


def _scan(text: bytes, needles: frozenset[bytes]) -> dict[bytes, list[Sample]]:
    """The finite samples of each family in ``needles`` found in ``text``, in one pass."""
    groups: dict[bytes, list[Sample]] = {}
    group: list[Sample] | None = None  # the family the previous line belongs to, if wanted
    group_name = b""
    head = _SAMPLE_NAME.match
    for line in text.split(b"\n"):
        found = head(line)
        if found is None:  # a comment, a blank line, no sample: the group ends
            group = None
            continue
        name = found.group()
        if group is None or name != group_name:
            if name not in needles or name in groups:  # another family, or a later group
                group = None
                continue
            group = groups[name] = []
            group_name = name
        sample = _sample(line[len(name) :].rstrip(b"\r"))
        if sample is not None and math.isfinite(sample[1]):
            group.append(sample)
    return groups


def _search(text: bytes, needle: bytes, hints: Hints | None) -> list[Sample] | None:
    """The finite samples of family ``needle``, found with ``bytes.find``; ``None`` if absent."""
    size = len(needle)
    start = _hinted_start(text, needle, hints) if hints is not None else -1
    if start < 0:
        start = _family_start(text, needle)
        if hints is not None:
            if start >= 0:
                hints[needle] = start
            else:
                hints.pop(needle, None)
    if start < 0:
        return None
    samples: list[Sample] = []
    while True:
        end = text.find(b"\n", start)
        if end < 0:
            end = len(text)
        sample = _sample(text[start + size : end].rstrip(b"\r"))
        if sample is not None and math.isfinite(sample[1]):
            samples.append(sample)
        start = end + 1
        if not (text.startswith(needle, start) and text[start + size : start + size + 1] in _NEXT):
            return samples


_NEXT = (b"{", b" ", b"\t")


def _hinted_start(text: bytes, needle: bytes, hints: Hints) -> int:
    """The family's first sample line if it is within the window of its hint, else -1."""
    hint = hints.get(needle)
    if hint is None:
        return -1
    size = len(needle)
    newline_needle = b"\n" + needle
    pos = text.find(newline_needle, max(0, hint - _HINT_WINDOW - 1), hint + _HINT_WINDOW + size)
    while pos >= 0:
        start, after = pos + 1, pos + 1 + size
        if after < len(text) and text[after] in _BOUNDARY:
            previous = text.rfind(b"\n", 0, pos) + 1  # the line before: the family's metadata
            line = text[previous:pos].rstrip(b"\r")
            if line.startswith((b"# TYPE ", b"# HELP ")) and line[7:].split(b" ", 1)[0] == needle:
                hints[needle] = start
                return start
            return -1  # inside the group, or no metadata: search the whole page
        pos = text.find(newline_needle, after, hint + _HINT_WINDOW + size)
    return -1


def _family_start(text: bytes, needle: bytes) -> int:
    """Offset of the first sample line of family ``needle``, or -1."""
    size = len(needle)
    if text.startswith(needle) and len(text) > size and text[size] in _BOUNDARY:
        return 0
    newline_needle = b"\n" + needle
    pos = text.find(newline_needle)
    while pos >= 0:
        after = pos + 1 + size
        if after < len(text) and text[after] in _BOUNDARY:
            return pos + 1
        pos = text.find(newline_needle, after)
    return -1


def _sample(rest: bytes) -> Sample | None:
    """Split what follows the name, ``{labels} value [timestamp]``; ``None`` if malformed."""
    labels = b""
    if rest.startswith(b"{"):
        close = rest.rfind(b"}")  # numbers follow the last brace; values may hold braces
        if close < 0:
            return None
        labels, rest = rest[1:close], rest[close + 1 :]
    fields = rest.split()
    if not fields:
        return None
    try:
        return labels, float(fields[0])
    except ValueError:
        return None


def parse_labels(block: bytes) -> Labels:
    """Decode a label block (``a="1",b="x\\"y"``) into a dict; malformed tails are dropped."""
    return dict(_label_items(block))


# Info gauges repeat the same label blocks scrape after scrape: decode each distinct one once.
@lru_cache(maxsize=4096)
def _label_items(block: bytes) -> tuple[tuple[str, str], ...]:
    labels: Labels = {}
    pos = 0
    while pos < len(block):
        match = _LABEL.match(block, pos)
        if match is None:
            break
        value = match.group(2)
        if b"\\" in value:
            value = _ESCAPES.sub(lambda m: _UNESCAPE.get(m.group(1), m.group(0)), value)
        labels[match.group(1).decode()] = value.decode(errors="replace")
        pos = match.end()
    return tuple(labels.items())


def _matches(block: bytes, spec: MetricSpec) -> bool:
    if not spec.labels:
        return True
    labels = parse_labels(block)
    return all(labels.get(key) == value for key, value in spec.labels)


def _label_values(samples: list[Sample] | None, label: str) -> frozenset[str]:
    values = (parse_labels(block).get(label) for block, _ in samples or () if block)
    return frozenset(value for value in values if value)


def _lora(samples: list[Sample] | None) -> tuple[frozenset[str], frozenset[str], int | None]:
    """Running and waiting adapters and slots; ``None`` slots when there is no sample yet."""
    if not samples:
        return frozenset(), frozenset(), None
    block, _ = max(samples, key=lambda sample: sample[1])
    return _lora_state(block)


# A server's LoRA info block changes only when its adapters do: decode each distinct one once.
@lru_cache(maxsize=1024)
def _lora_state(block: bytes) -> tuple[frozenset[str], frozenset[str], int]:
    labels = parse_labels(block)
    return (
        _adapters(labels.get("running_lora_adapters", "")),
        _adapters(labels.get("waiting_lora_adapters", "")),
        _int(labels.get("max_lora")) or 0,
    )


def _adapters(listing: str) -> frozenset[str]:
    return frozenset(name for part in listing.split(",") if (name := part.strip()))


def _cache_geometry(family: Family, names: EngineMetricNames) -> tuple[int | None, int | None]:
    block_size = num_blocks = None
    info = _first_present(family, names.cache_info)
    if info:
        labels = parse_labels(info[0][0])
        block_size = _int(labels.get(names.cache_block_size_label))
        num_blocks = _int(labels.get(names.cache_num_blocks_label))
    if block_size is None:
        block_size = _gauge_int(_first_present(family, names.block_size))
    if num_blocks is None:
        num_blocks = _gauge_int(_first_present(family, names.num_gpu_blocks))
    return block_size, num_blocks


def _gauge_int(samples: list[Sample] | None) -> int | None:
    return round(samples[0][1]) if samples else None


def _int(text: str | None) -> int | None:
    """A positive integer label (vLLM writes ``"None"`` when unset); ``None`` otherwise."""
    try:
        value = int(float(text)) if text else None
    except (ValueError, OverflowError):
        return None
    return value if value is not None and value > 0 else None
