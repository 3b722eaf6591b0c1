"""One ``/metrics`` view over the parent and its workers, with today's names and labels.

Each process keeps its own ``EppMetrics`` registry; the parent asks every worker for its
exposition (text) over the channel when ``/metrics`` is scraped, and sums the samples of equal
name and labels: counters, histogram buckets, sums and counts add up, and so do gauges that
count things (running requests, open streams, buffered bytes, queue sizes, event-loop tasks).
Families that describe one process or the pool rather than traffic (``process_*``,
``python_*``, the pool gauges, the pool source's reload outcomes) come from the parent alone:
the workers hold the same pool, and a sum of start times or of pool averages means nothing.
A worker that dies leaves its last counters and histograms in a retired sum (``cumulative_only``),
and one that misses an ask keeps its previous answer, so merged totals never go down.

prometheus_client's multiprocess mode was the alternative: it cannot serve our custom
collectors (``LoopHistogram``, the pool collector) nor callback gauges (``set_function``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PARENT_ONLY = (
    "process_",
    "python_",
    "inference_pool_",
    "inference_extension_pool_reload",
    "inference_extension_pool_source_healthy",
    "inference_extension_metrics_",  # scraping: the parent scrapes for every worker
)
REQUEST_COUNTER = "inference_model_request_total"


class _Families:
    """What ``generate_latest`` renders: anything with ``collect``."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_expositions(parent: bytes, workers: Sequence[bytes]) -> bytes:
    """The parent's exposition with every worker's summed in (see the module docstring)."""
    merged: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, frozenset[tuple[str, str]]], Sample]] = {}
    for index, text in enumerate((parent, *workers)):
        for family in text_string_to_metric_families(text.decode("utf-8")):
            if index > 0 and family.name.startswith(PARENT_ONLY):
                continue
            if family.name not in merged:
                merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
                sums[family.name] = {}
            samples = sums[family.name]
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                seen = samples.get(key)
                samples[key] = (
                    sample if seen is None else seen._replace(value=seen.value + sample.value)
                )
    for name, family in merged.items():
        family.samples = list(sums[name].values())
    return generate_latest(_Families(merged.values()))


def cumulative_only(text: bytes) -> bytes:
    """Only the counters, histograms and summaries of an exposition (not the parent-only
    families): what a dead worker leaves behind so that merged totals never go down."""
    kept = [
        family
        for family in text_string_to_metric_families(text.decode("utf-8"))
        if family.type in ("counter", "histogram", "summary")
        and not family.name.startswith(PARENT_ONLY)
    ]
    return generate_latest(_Families(kept))


def requests_counted(text: bytes) -> float:
    """The sum of ``inference_model_request_total`` in one exposition (per-worker balance)."""
    total = 0.0
    for line in text.decode("utf-8").splitlines():
        if line.startswith(REQUEST_COUNTER):
            total += float(line.rpartition(" ")[2])
    return total
