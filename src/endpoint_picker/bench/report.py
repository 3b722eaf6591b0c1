"""What a run leaves behind: ``results.json``, the markdown table and the PNG plots.

``results.json`` holds everything needed to re-render (every request record, the fleet's
observations, and ``meta``: the command line, workload parameters, fleet flags), so the table and
plots can be redrawn, or drawn differently, without running again (``epp bench report DIR``).
Reply texts are not kept: they only fed later chat turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from endpoint_picker.bench import envoytiming
from endpoint_picker.bench.model import (
    BenchError,
    FleetObservation,
    RequestRecord,
    RouterTiming,
    ServerObservation,
    ServerSample,
    TargetResult,
)
from endpoint_picker.bench.stats import ModelSummary, Summary, summarize, summarize_models
from endpoint_picker.bench.tenants import TenantSummary, has_tenants, summarize_tenants

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

RESULTS_FILE = "results.json"
_VERSION = 1


def write_results(
    directory: str | Path, results: Sequence[TargetResult], meta: dict[str, Any]
) -> Path:
    """Write ``results.json`` into ``directory`` (created if needed); return its path."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    document = {"version": _VERSION, "meta": meta, "results": [_dump(r) for r in results]}
    out = path / RESULTS_FILE
    out.write_bytes(orjson.dumps(document, default=str))  # default=str: Paths etc. in meta
    return out


def _dump(result: TargetResult) -> dict[str, Any]:
    records = [
        {f: getattr(r, f) for f in RequestRecord.__slots__ if f != "reply_text"}
        for r in result.records
    ]
    return {
        "target": result.target,
        "workload": result.workload,
        "rate": result.rate,
        "duration": result.duration,
        "notes": result.notes,
        "warmup": result.warmup,
        "fleet": result.fleet,  # orjson writes dataclasses (and their tuples) natively
        "records": records,
        "router": result.router,
    }


def load_results(directory: str | Path) -> tuple[list[TargetResult], dict[str, Any]]:
    """Read back what ``write_results`` wrote: the results, and ``meta``."""
    path = Path(directory) / RESULTS_FILE
    try:
        document = orjson.loads(path.read_bytes())
        if document.get("version") != _VERSION:
            raise BenchError(f"{path}: unsupported results version {document.get('version')!r}")
        return [_load(r) for r in document["results"]], document["meta"]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise BenchError(f"cannot read {path}: {exc}") from exc


def _load(raw: dict[str, Any]) -> TargetResult:
    servers = tuple(
        ServerObservation(
            **{k: v for k, v in s.items() if k != "samples"},
            samples=tuple(ServerSample(**x) for x in s["samples"]),
        )
        for s in raw["fleet"]["servers"]
    )
    return TargetResult(
        target=raw["target"],
        workload=raw["workload"],
        rate=raw["rate"],
        duration=raw["duration"],
        records=tuple(RequestRecord(**r) for r in raw["records"]),
        fleet=FleetObservation(servers),
        notes=tuple(raw["notes"]),
        warmup=raw.get("warmup", 0.0),
        router=_router(raw.get("router")),
    )


def _router(raw: dict[str, Any] | None) -> RouterTiming | None:
    if raw is None:
        return None
    return RouterTiming(raw["requests"], tuple(raw["to_upstream"]), tuple(raw["to_client"]))


_COLUMNS = (
    "target", "workload", "rate", "ok/sent", "errors",
    "TTFT p50 (ms)", "TTFT p90 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p90 (ms)",
    "e2e p50 (s)", "e2e p90 (s)", "req/s", "tok/s", "hit rate", "oracle hit", "max/mean load",
    "valid",
)  # fmt: skip


def markdown_table(summaries: Sequence[Summary]) -> str:
    """One row per target and rate, then a line per invalid row saying why."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    why: list[str] = []
    for s in summaries:
        cells = (
            s.target, s.workload, f"{s.rate:g}", f"{s.completed}/{s.sent}",
            " ".join(f"{k}:{n}" for k, n in s.errors.items()) or "-",
            _num(s.ttft_p50, 1e3, 0), _num(s.ttft_p90, 1e3, 0), _num(s.ttft_p99, 1e3, 0),
            _num(s.tpot_p50, 1e3, 1), _num(s.tpot_p90, 1e3, 1),
            _num(s.e2e_p50, 1, 2), _num(s.e2e_p90, 1, 2),
            _num(s.requests_per_s, 1, 1), _num(s.output_tokens_per_s, 1, 0),
            "-" if s.hit_rate is None else f"{s.hit_rate:.0%}",
            "-" if s.oracle_hit_rate is None else f"{s.oracle_hit_rate:.0%}",
            _num(s.load_ratio, 1, 2), "yes" if s.valid else "**no**",
        )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
        why += [f"- {s.target} at {s.rate:g} req/s: {reason}" for reason in s.reasons]
    return "\n".join(lines + (["", *why] if why else [])) + "\n"


_MODEL_COLUMNS = (
    "target", "rate", "model", "objective (ms)", "ok/sent", "TPOT p95 (ms)",
    "latency/token p95 (ms)", "met objective",
)  # fmt: skip


def objective_table(summaries: Sequence[ModelSummary]) -> str:
    """A row per served name of each target and rate: how each fared against its objective
    (the names without one show what the objective traffic's protection cost them)."""
    lines = ["| " + " | ".join(_MODEL_COLUMNS) + " |", "|" + "---|" * len(_MODEL_COLUMNS)]
    for s in summaries:
        cells = (
            s.target, f"{s.rate:g}", s.model or "-", _num(s.objective, 1e3, 0),
            f"{s.completed}/{s.sent}", _num(s.tpot_p95, 1e3, 1), _num(s.per_token_p95, 1e3, 1),
            "-" if s.met is None else f"{s.met:.1%}",
        )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def tables(
    results: Sequence[TargetResult],
    objectives: dict[str, float],
    criticality: dict[str, str] | None = None,
) -> str:
    """The main table; with objectives in the plan, the per-model one after it; with
    criticality classes (``mixed-criticality``), a per-class one; with fairness ids on the
    requests (``two-tenants``), a per-tenant one."""
    text = markdown_table([summarize(r) for r in results])
    if objectives:
        rows = [m for r in results for m in summarize_models(r, objectives)]
        text += "\nPer model (objective: P95 of e2e / output tokens):\n\n" + objective_table(rows)
    if criticality and len(criticality) > 1:  # one class alone (``two-tenants``): no contrast
        rows = [m for r in results for m in summarize_models(r, objectives)]
        text += "\nPer criticality class:\n\n" + criticality_table(rows, criticality)
    if timings := [(r.target, r.rate, r.router) for r in results if r.router is not None]:
        text += (
            "\nWhat the router added, as the Envoy in front of it logged it (to upstream: from "
            "the end of the client's request to the upstream request; to client: from the "
            "server's first response byte to the first byte sent on):\n\n"
            + envoytiming.timing_table(timings)
        )
    if any(has_tenants(r) for r in results):
        by_tenant = [t for r in results for t in summarize_tenants(r)]
        text += (
            "\nPer tenant (share in window: of the completions within the measured window, "
            "the fairness figure; share of ok: of the completed requests sent in it):\n\n"
            + tenant_table(by_tenant)
        )
    return text


_CLASS_COLUMNS = (
    "target", "rate", "model", "criticality", "ok/sent", "errors", "TTFT p50 (ms)",
    "TTFT p90 (ms)", "e2e p90 (s)",
)  # fmt: skip


def criticality_table(summaries: Sequence[ModelSummary], criticality: dict[str, str]) -> str:
    """A row per served name of each target and rate, with its criticality: who got through,
    who was refused (429, 503), and how long the ones that got through waited."""
    lines = ["| " + " | ".join(_CLASS_COLUMNS) + " |", "|" + "---|" * len(_CLASS_COLUMNS)]
    for s in summaries:
        errors = ", ".join(f"{k}: {v}" for k, v in s.errors.items()) or "-"
        cells = (
            s.target, f"{s.rate:g}", s.model or "-", criticality.get(s.model, "-"),
            f"{s.completed}/{s.sent}", errors, _num(s.ttft_p50, 1e3, 0),
            _num(s.ttft_p90, 1e3, 0), _num(s.e2e_p90, 1, 2),
        )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_TENANT_COLUMNS = (
    "target", "rate", "tenant", "ok/sent", "errors", "TTFT p50 (ms)", "TTFT p90 (ms)",
    "e2e p90 (s)", "share of ok", "req/s in window", "share in window",
)  # fmt: skip


def tenant_table(summaries: Sequence[TenantSummary]) -> str:
    """A row per tenant of each target and rate: who got through, who was refused, how long
    they waited, and each tenant's share of what was served (see ``tenants``)."""
    lines = ["| " + " | ".join(_TENANT_COLUMNS) + " |", "|" + "---|" * len(_TENANT_COLUMNS)]
    for s in summaries:
        errors = ", ".join(f"{k}: {v}" for k, v in s.errors.items()) or "-"
        cells = (
            s.target, f"{s.rate:g}", s.tenant or "-", f"{s.completed}/{s.sent}", errors,
            _num(s.ttft_p50, 1e3, 0), _num(s.ttft_p90, 1e3, 0), _num(s.e2e_p90, 1, 2),
            _share(s.share_of_completed), _num(s.window_per_s, 1, 1), _share(s.window_share),
        )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None, scale: float, digits: int) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def write_plots(directory: str | Path, results: Sequence[TargetResult]) -> list[Path]:
    """Draw the three PNGs into ``directory``; return their paths.

    ``latency_vs_rate.png``: TTFT p50, TTFT p90 and e2e p90 against rate, a line per target
    (invalid points crossed). ``requests_per_server.png``: requests each server served, bars
    grouped by target, a panel per rate. ``queue_over_time.png``: each server's waiting queue
    over the run, a panel per target at the highest rate.
    """
    # Imported here: matplotlib is slow to import and only the report needs it. The Agg canvas
    # renders without a display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "latency_vs_rate.png": _latency(Figure(figsize=(15, 4.5)), results),
        "requests_per_server.png": _per_server(Figure(), results),
        "queue_over_time.png": _queues(Figure(), results),
    }
    paths = []
    for name, figure in figures.items():
        FigureCanvasAgg(figure)
        figure.savefig(out / name, dpi=100)
        paths.append(out / name)
    return paths


def _label(result: TargetResult, results: Sequence[TargetResult]) -> str:
    several = len({r.workload for r in results}) > 1
    return f"{result.workload}: {result.target}" if several else result.target


def _latency(figure: Figure, results: Sequence[TargetResult]) -> Figure:
    panels = (("TTFT p50 (ms)", "ttft_p50", 1e3), ("TTFT p90 (ms)", "ttft_p90", 1e3),
              ("e2e p90 (s)", "e2e_p90", 1.0))  # fmt: skip
    lines: dict[str, list[Summary]] = {}
    for result in results:
        lines.setdefault(_label(result, results), []).append(summarize(result))
    axes: list[Axes] = list(figure.subplots(1, len(panels), squeeze=False)[0])
    for ax, (title, attr, scale) in zip(axes, panels, strict=True):
        for label, summaries in lines.items():
            points = sorted((s.rate, v * scale, s.valid) for s in summaries
                            if (v := getattr(s, attr)) is not None)  # fmt: skip
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
            bad = [p for p in points if not p[2]]
            ax.scatter([p[0] for p in bad], [p[1] for p in bad], marker="x", s=80, color="black")
        ax.set(title=title, xlabel="rate (req/s)")
        ax.grid(alpha=0.3)
    if lines:
        axes[0].legend()
    if any(not s.valid for summaries in lines.values() for s in summaries):
        figure.suptitle("x: invalid run (see the table)", fontsize="small", x=0.99, ha="right")
    figure.tight_layout()
    return figure


def _per_server(figure: Figure, results: Sequence[TargetResult]) -> Figure:
    panels = sorted({(r.workload, r.rate) for r in results})
    figure.set_size_inches(10, 3.2 * max(1, len(panels)))
    axes: list[Axes] = list(figure.subplots(max(1, len(panels)), 1, squeeze=False)[:, 0])
    for ax, (workload, rate) in zip(axes, panels, strict=False):
        group = [r for r in results if (r.workload, r.rate) == (workload, rate)]
        width = 0.8 / len(group)
        for k, result in enumerate(group):
            counts = [s.requests for s in result.fleet.servers]
            xs = [i + (k - (len(group) - 1) / 2) * width for i in range(len(counts))]
            ax.bar(xs, counts, width=width, label=result.target)
        servers = max(len(r.fleet.servers) for r in group)
        ax.set_xticks(range(servers))
        ax.set(title=f"{workload} at {rate:g} req/s", xlabel="server (fleet order)",
               ylabel="requests")  # fmt: skip
        ax.legend(fontsize="small")
    figure.tight_layout()
    return figure


def _queues(figure: Figure, results: Sequence[TargetResult]) -> Figure:
    top = [r for r in results if r.rate == max((x.rate for x in results), default=0.0)]
    figure.set_size_inches(10, 3.2 * max(1, len(top)))
    axes: list[Axes] = list(figure.subplots(max(1, len(top)), 1, squeeze=False, sharex=True)[:, 0])
    for ax, result in zip(axes, top, strict=False):
        for server in result.fleet.servers:
            ts = [x.t for x in server.samples]
            ax.plot(ts, [x.waiting for x in server.samples], linewidth=1, label=server.name)
        ax.set(title=f"{_label(result, results)} at {result.rate:g} req/s", ylabel="waiting")
        if 0 < len(result.fleet.servers) <= 8:  # beyond that a legend hides the lines
            ax.legend(fontsize="small")
    axes[-1].set_xlabel("time (s)")
    figure.tight_layout()
    return figure


def render(directory: str | Path) -> str:
    """``epp bench report DIR``: print the table of ``DIR/results.json`` and redraw its plots."""
    results, meta = load_results(directory)
    table = tables(results, dict(meta.get("objectives") or {}), dict(meta.get("criticality") or {}))
    print(table, end="")
    write_plots(directory, results)
    return table
