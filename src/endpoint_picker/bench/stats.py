"""Percentiles, one ``Summary`` per target and rate, and the check that a run measured the router.

A run is only worth comparing if the requests went out when the workload said and the simulated
GPUs kept their clocks: on two shared cores either can slip, and then the router is blamed for
the machine. ``validity`` names every such slip; a run with a reason is shown but marked invalid.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from endpoint_picker.bench.client import PREVIOUS_TURN_FAILED
from endpoint_picker.bench.model import RequestRecord, TargetResult

# A run is invalid past these (see ``validity``).
SEND_SPAN_LIMIT = 0.05  # sends spread 5% wider than their due times: the offered rate was lower
SEND_LAG_LIMIT = 0.05  # mean send lag as a share of the mean gap between arrivals
SEND_LAG_FLOOR = 0.002  # seconds; a lag under the event loop's timer resolution reshapes nothing
STEP_LATE_LIMIT = 0.05  # sim:step_late_seconds / sim:step_planned_seconds over the fleet
STEP_BEHIND_LIMIT = 0.01  # sim:step_behind_seconds / planned: >1% of simulated GPU time lost


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, ``None`` when there are none.

    Linear interpolation between the closest ranks, as ``numpy.percentile``'s default: the
    sorted values sit at ranks 0..n-1 and rank ``q/100 * (n-1)`` is interpolated.

    The one percentile of every benchmark figure (``epp bench run``'s tables, ``epp bench
    soak``, the scripts in ``benchmarks/``). Interpolated rather than nearest rank because it
    is what numpy and pandas compute from ``results.json`` or ``samples.csv`` by default, it
    moves smoothly with the data where nearest rank jumps (``ordered[int(0.99 * n)]`` is the
    maximum for any n up to 100: one outlier), and the README's routing tables were made with it.
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Summary:
    """One target at one rate, in the table's terms. Latencies in seconds; ``None``: no data.

    ``errors`` counts failed requests by kind: the HTTP status (``"503"``), ``"connection"`` (no
    HTTP answer), ``"stream"`` (a 200 whose stream broke or carried an error), ``"skipped"`` (a
    chat turn whose previous turn failed). ``requests_per_s`` and ``output_tokens_per_s`` are over
    the span from the first send to the last successful finish. ``load_ratio`` is the busiest
    server's requests over the mean (1.0 is perfectly even); ``hit_rate`` is prefix-cache hit
    tokens over queried tokens, over the whole fleet.
    """

    target: str
    workload: str
    rate: float
    sent: int
    completed: int
    errors: dict[str, int]
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p90: float | None
    e2e_p50: float | None
    e2e_p90: float | None
    requests_per_s: float | None
    output_tokens_per_s: float | None
    hit_rate: float | None
    # The ideal: the longest prefix cached anywhere in the fleet at each admission (the sim's
    # sim:prefix_cache_oracle_hits over queried tokens); None unless every server reports it.
    oracle_hit_rate: float | None
    per_server: tuple[tuple[str, int], ...]
    load_ratio: float | None
    valid: bool
    reasons: tuple[str, ...]
    notes: tuple[str, ...] = ()


def error_kind(record: RequestRecord) -> str:
    """How a failed request failed (the keys of ``Summary.errors``)."""
    if record.error == PREVIOUS_TURN_FAILED:
        return "skipped"
    if record.status == 0:
        return "connection"
    if record.status == 200:
        return "stream"
    return str(record.status)


def measured(result: TargetResult) -> list[RequestRecord]:
    """The records the summary is about: those due after the warm-up (all of them without one)."""
    return [r for r in result.records if r.due_at >= result.warmup]


def summarize(result: TargetResult) -> Summary:
    """``result`` in the table's terms, over its measured requests (see ``measured``).

    Validity is judged over every request sent, warm-up included: a slip anywhere shapes the
    caches the measured part starts from.
    """
    records = measured(result)
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    span = _span(records, ok)
    servers = result.fleet.servers
    queries = sum(s.prefix_cache_queries for s in servers)
    hits = sum(s.prefix_cache_hits for s in servers)
    oracle = [s.oracle_hits for s in servers]
    oracle_hits = None if None in oracle or not servers else sum(h or 0.0 for h in oracle)
    served = [s.requests for s in servers]
    mean_load = sum(served) / len(served) if served else 0.0
    reasons = validity(result)
    return Summary(
        target=result.target,
        workload=result.workload,
        rate=result.rate,
        sent=sum(1 for r in records if r.error != PREVIOUS_TURN_FAILED),
        completed=len(ok),
        errors=dict(sorted(Counter(error_kind(r) for r in records if not r.ok).items())),
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50),
        tpot_p90=percentile(tpot, 90),
        e2e_p50=percentile(e2e, 50),
        e2e_p90=percentile(e2e, 90),
        requests_per_s=len(ok) / span if span else None,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / span if span else None,
        hit_rate=hits / queries if queries else None,
        oracle_hit_rate=oracle_hits / queries if queries and oracle_hits is not None else None,
        per_server=tuple((s.name, s.requests) for s in servers),
        load_ratio=max(served) / mean_load if mean_load else None,
        valid=not reasons,
        reasons=tuple(reasons),
        notes=result.notes,
    )


@dataclass(frozen=True, slots=True)
class ModelSummary:
    """One served name of a run whose plan set a latency objective (``objective`` seconds per
    output token, ``None`` for the names without one). ``per_token_p95``: the P95 of each
    completed request's e2e / output tokens, the objective's metric (TPOT leaves out the
    queueing and prefill it includes); ``met``: the share of the name's measured requests that
    completed within the objective (a failed request did not)."""

    target: str
    rate: float
    model: str
    objective: float | None
    sent: int
    completed: int
    tpot_p95: float | None
    per_token_p95: float | None
    met: float | None
    errors: dict[str, int] = field(default_factory=dict)  # by kind, as ``Summary.errors``
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    e2e_p90: float | None = None


def summarize_models(result: TargetResult, objectives: Mapping[str, float]) -> list[ModelSummary]:
    """A ``ModelSummary`` per served name in ``result``'s measured requests, objectives first."""
    by_model: dict[str, list[RequestRecord]] = {}
    for record in measured(result):
        if record.error != PREVIOUS_TURN_FAILED:
            by_model.setdefault(record.model, []).append(record)
    out = []
    for model in sorted(by_model, key=lambda m: (m not in objectives, m)):
        records = by_model[model]
        ok = [r for r in records if r.ok]
        per_token = [t for r in ok if (t := r.per_token) is not None]
        objective = objectives.get(model)
        met = None
        if objective is not None:
            met = sum(1 for t in per_token if t <= objective) / len(records)
        out.append(
            ModelSummary(
                target=result.target,
                rate=result.rate,
                model=model,
                objective=objective,
                sent=len(records),
                completed=len(ok),
                tpot_p95=percentile([t for r in ok if (t := r.tpot) is not None], 95),
                per_token_p95=percentile(per_token, 95),
                met=met,
                errors=dict(sorted(Counter(error_kind(r) for r in records if not r.ok).items())),
                ttft_p50=percentile([t for r in ok if (t := r.ttft) is not None], 50),
                ttft_p90=percentile([t for r in ok if (t := r.ttft) is not None], 90),
                e2e_p90=percentile([t for r in ok if (t := r.e2e) is not None], 90),
            )
        )
    return out


def _span(records: Sequence[RequestRecord], ok: Sequence[RequestRecord]) -> float | None:
    """Seconds from the first send to the last successful finish; ``None`` if not positive."""
    if not ok:
        return None
    first = min(r.sent_at for r in records)
    last = max(r.sent_at + (r.e2e or 0.0) for r in ok)
    return last - first if last > first else None


def validity(result: TargetResult) -> list[str]:
    """Why ``result`` does not measure the router (empty: it does). Definitions:

    - **the offered rate slipped**: the sends span (last send - first send) is more than
      ``SEND_SPAN_LIMIT`` (5%) longer than the due span (last due - first due): the client
      fell behind and the fleet saw a lower rate than asked.
    - **sends lagged**: the mean send lag (``sent_at - due_at``) is more than ``SEND_LAG_LIMIT``
      (5%) of the mean gap between arrivals (due span / (n - 1)), and more than
      ``SEND_LAG_FLOOR`` (2 ms, the event loop's timer resolution), so arrivals were reshaped.
      Chat turns are due when their previous turn finished, so waiting for it is not lag.
    - **the simulated fleet's clock slipped**: over the fleet, ``sim:step_late_seconds`` over
      ``sim:step_planned_seconds`` (deltas over the run) is above ``STEP_LATE_LIMIT`` (5%), or
      ``sim:step_behind_seconds`` grew by more than ``STEP_BEHIND_LIMIT`` (1%) of the planned time
      (simulated GPU time was lost).
      Skipped for servers without these series (a real vLLM).
    - **nothing completed**.

    Skipped chat turns (their previous turn failed) were never sent and are left out.
    """
    reasons: list[str] = []
    sent = sorted(
        (r for r in result.records if r.error != PREVIOUS_TURN_FAILED), key=lambda r: r.due_at
    )
    if not any(r.ok for r in result.records):
        reasons.append("no request completed")
    if len(sent) >= 2:
        due_span = sent[-1].due_at - sent[0].due_at
        send_span = max(r.sent_at for r in sent) - min(r.sent_at for r in sent)
        if due_span > 0 and send_span > due_span * (1 + SEND_SPAN_LIMIT):
            reasons.append(
                f"load generator slipped: sends spanned {send_span:.2f} s for {due_span:.2f} s"
                f" of arrivals (+{send_span / due_span - 1:.1%})"
            )
        gap = due_span / (len(sent) - 1)
        lag = sum(r.sent_at - r.due_at for r in sent) / len(sent)
        if lag > max(gap * SEND_LAG_LIMIT, SEND_LAG_FLOOR):
            reasons.append(
                f"load generator lagged: mean send lag {lag * 1e3:.1f} ms"
                f" = {lag / gap if gap else math.inf:.1%} of the {gap * 1e3:.1f} ms mean gap"
            )
    clocked = [s for s in result.fleet.servers if s.step_planned_seconds]
    planned = sum(s.step_planned_seconds or 0.0 for s in clocked)
    if planned > 0:
        late = sum(s.step_late_seconds or 0.0 for s in clocked)
        behind = sum(s.step_behind_seconds or 0.0 for s in clocked)
        if late / planned > STEP_LATE_LIMIT:
            reasons.append(f"simulated fleet ran late: step late/planned {late / planned:.1%}")
        if behind / planned > STEP_BEHIND_LIMIT:
            reasons.append(
                f"simulated fleet fell behind: {behind * 1e3:.0f} ms of GPU time lost"
                f" ({behind / planned:.2%} of planned)"
            )
    return reasons
