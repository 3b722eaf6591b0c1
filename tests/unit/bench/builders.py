"""Tiny builders for bench tests: records, servers and results by hand."""

from __future__ import annotations

from typing import Any

from endpoint_picker.bench.model import (
    FleetObservation,
    RequestRecord,
    ServerObservation,
    ServerSample,
    TargetResult,
)


def record(
    index: int = 0,
    due: float = 0.0,
    sent: float | None = None,
    *,
    status: int = 200,
    ttft: float | None = 0.1,
    e2e: float | None = 1.0,
    out: int = 10,
    error: str = "",
) -> RequestRecord:
    """A finished request, sent when due unless ``sent`` says otherwise."""
    return RequestRecord(index, due, due if sent is None else sent, status, ttft, e2e, out, 100,
                         error)  # fmt: skip


def server(
    name: str = "127.0.0.2:8000", requests: int = 10, *, queries: float = 0.0, hits: float = 0.0,
    planned: float | None = None, late: float | None = None, behind: float | None = None,
    waiting: tuple[float, ...] = (),
) -> ServerObservation:  # fmt: skip
    """One server's observation; ``waiting`` becomes samples at t = 0, 1, 2, ..."""
    samples = tuple(ServerSample(float(t), w, 1.0, 0.5) for t, w in enumerate(waiting))
    return ServerObservation(name, requests, queries, hits, samples, planned, late, behind)


def result(
    records: tuple[RequestRecord, ...] = (),
    servers: tuple[ServerObservation, ...] = (),
    **overrides: Any,
) -> TargetResult:
    """A target result; ``overrides`` go to ``TargetResult`` (target, workload, rate, ...)."""
    fields: dict[str, Any] = {"target": "rr", "workload": "shared-prefix", "rate": 10.0,
                              "duration": 10.0}  # fmt: skip
    fields.update(overrides)
    return TargetResult(records=records, fleet=FleetObservation(servers), **fields)


def steady(n: int = 11, gap: float = 0.1, **kwargs: Any) -> tuple[RequestRecord, ...]:
    """``n`` successful requests due (and sent) every ``gap`` seconds."""
    return tuple(record(i, i * gap, **kwargs) for i in range(n))
