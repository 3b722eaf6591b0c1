"""Who of several tenants got served: a ``TenantSummary`` per fairness id of a run.

A tenant is the ``x-gateway-inference-fairness-id`` a request carried (``RequestRecord.tenant``;
the ``two-tenants`` workload sets it). The question is flow control's fairness: under
saturation, which share of the dispatches did each tenant get?

The client cannot see the EPP's queue, so dispatches are measured by their consequence:
completions per second within the measured window (``[warmup, warmup + duration]``, counted by
finish time, whenever the request was sent). While the pool stays saturated through the window,
requests complete at the rate they are dispatched, a service time later, so the shares agree.
The share of the completed requests *sent* in the window is shown too, but it is not the
fairness figure: after the last arrival the backlog (mostly the heavy tenant's) drains with
nobody left to compete, and every request of it that completes counts for its tenant.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from endpoint_picker.bench.client import PREVIOUS_TURN_FAILED
from endpoint_picker.bench.model import RequestRecord, TargetResult
from endpoint_picker.bench.stats import error_kind, measured, percentile


@dataclass(frozen=True, slots=True)
class TenantSummary:
    """One tenant of one target at one rate. Latencies in seconds; ``None``: no data.

    ``sent``, ``completed``, ``errors`` and the latencies are over the measured requests (sent
    in the window, as ``stats.summarize``); ``share_of_completed`` is the tenant's share of
    their completions. ``window_per_s``: the tenant's completions that finished within the
    measured window, per second of it; ``window_share``: its share of those (the fairness
    figure, see the module docstring).
    """

    target: str
    rate: float
    tenant: str
    sent: int
    completed: int
    errors: dict[str, int]
    ttft_p50: float | None
    ttft_p90: float | None
    e2e_p90: float | None
    share_of_completed: float | None
    window_per_s: float | None
    window_share: float | None


def has_tenants(result: TargetResult) -> bool:
    """Whether any request of ``result`` carried a fairness id."""
    return any(r.tenant for r in result.records)


def summarize_tenants(result: TargetResult) -> list[TenantSummary]:
    """A ``TenantSummary`` per tenant of ``result`` (``""``: requests without one), by name."""
    by_tenant: dict[str, list[RequestRecord]] = {}
    for record in measured(result):
        if record.error != PREVIOUS_TURN_FAILED:
            by_tenant.setdefault(record.tenant, []).append(record)
    start, end = result.warmup, result.warmup + result.duration
    in_window = Counter(
        r.tenant for r in result.records if r.ok and start <= r.sent_at + (r.e2e or 0.0) <= end
    )
    completed_total = sum(1 for rs in by_tenant.values() for r in rs if r.ok)
    window_total = sum(in_window.values())
    out = []
    for tenant in sorted(by_tenant.keys() | in_window.keys()):
        records = by_tenant.get(tenant, [])
        ok = [r for r in records if r.ok]
        ttft = [t for r in ok if (t := r.ttft) is not None]
        out.append(
            TenantSummary(
                target=result.target,
                rate=result.rate,
                tenant=tenant,
                sent=len(records),
                completed=len(ok),
                errors=dict(sorted(Counter(error_kind(r) for r in records if not r.ok).items())),
                ttft_p50=percentile(ttft, 50),
                ttft_p90=percentile(ttft, 90),
                e2e_p90=percentile([t for r in ok if (t := r.e2e) is not None], 90),
                share_of_completed=len(ok) / completed_total if completed_total else None,
                window_per_s=in_window[tenant] / result.duration if result.duration > 0 else None,
                window_share=in_window[tenant] / window_total if window_total else None,
            )
        )
    return out
