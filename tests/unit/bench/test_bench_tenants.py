"""Per-tenant results: the client records each request's fairness id, the summary counts each
tenant's share of what was served, the report renders it and re-renders it from results.json."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tests.unit.bench.builders import record, result
from tests.unit.bench.test_bench_client import SseServer, completion

from endpoint_picker.bench.client import run_requests
from endpoint_picker.bench.model import FAIRNESS_HEADER, RequestRecord, TargetResult
from endpoint_picker.bench.report import render, tables, tenant_table, write_results
from endpoint_picker.bench.stacks import pool_file
from endpoint_picker.bench.tenants import TenantSummary, summarize_tenants
from endpoint_picker.bench.workloads import generate
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.types import Criticality


def _rec(index: int, tenant: str, sent: float, e2e: float | None = 1.0) -> RequestRecord:
    """A request of ``tenant`` sent at ``sent``; ``e2e=None``: refused with a 503."""
    if e2e is None:
        return replace(record(index, sent, status=503, ttft=None, e2e=None, out=0), tenant=tenant)
    return replace(record(index, sent, e2e=e2e), tenant=tenant)


def _saturated() -> TargetResult:
    """Measured window [10, 20]. heavy: one warm-up request finishing in the window, three
    finishing in it, one sent at 19 finishing at 24 (the drained backlog), one 503; light:
    two finishing in the window."""
    records = (
        _rec(0, "heavy", 5.0, e2e=7.0),
        _rec(1, "heavy", 11.0), _rec(2, "heavy", 12.0), _rec(3, "heavy", 13.0),
        _rec(4, "heavy", 19.0, e2e=5.0), _rec(5, "heavy", 14.0, e2e=None),
        _rec(6, "light", 11.0), _rec(7, "light", 12.0, e2e=3.0),
    )  # fmt: skip
    return result(records, target="epp", workload="two-tenants", rate=24.0, warmup=10.0)


def test_tenants_are_summarised_by_sends_and_by_completions_in_the_window() -> None:
    """ok/sent, errors and the share of ok count requests sent in the window; the window
    figures count completions that finished in it, warm-up sends included, backlog not."""
    heavy, light = summarize_tenants(_saturated())
    assert (heavy.tenant, heavy.sent, heavy.completed, heavy.errors) == ("heavy", 5, 4, {"503": 1})
    assert (light.tenant, light.sent, light.completed, light.errors) == ("light", 2, 2, {})
    assert heavy.share_of_completed == pytest.approx(4 / 6)
    assert (heavy.window_per_s, light.window_per_s) == (pytest.approx(0.4), pytest.approx(0.2))
    assert heavy.window_share == pytest.approx(4 / 6)
    assert light.window_share == pytest.approx(2 / 6)
    assert light.e2e_p90 == pytest.approx(2.8)
    assert (light.ttft_p50, light.target, light.rate) == (pytest.approx(0.1), "epp", 24.0)


def test_tenant_table_renders_hand_built_rows() -> None:
    """A row per tenant with every column; shares as percentages, missing figures as '-'."""
    rows = [
        TenantSummary("epp=fc.yaml", 28.0, "heavy", 1500, 600, {"503": 880, "429": 20}, 0.3123,
                      12.5, 20.25, 0.5, 6.1, 0.5049),
        TenantSummary("epp=fc.yaml", 28.0, "light", 500, 500, {}, 0.1, 0.2, 9.0, 0.5, 5.98,
                      0.4951),
        TenantSummary("rr", 28.0, "", 0, 0, {}, None, None, None, None, None, None),
    ]  # fmt: skip
    lines = tenant_table(rows).splitlines()
    assert lines[0] == (
        "| target | rate | tenant | ok/sent | errors | TTFT p50 (ms) | TTFT p90 (ms) | "
        "e2e p90 (s) | share of ok | req/s in window | share in window |"
    )
    assert lines[2] == (
        "| epp=fc.yaml | 28 | heavy | 600/1500 | 503: 880, 429: 20 | 312 | 12,500 | 20.25 | "
        "50.0% | 6.1 | 50.5% |"
    )
    assert lines[3] == (
        "| epp=fc.yaml | 28 | light | 500/500 | - | 100 | 200 | 9.00 | 50.0% | 6.0 | 49.5% |"
    )
    assert lines[4] == "| rr | 28 | - | 0/0 | - | - | - | - | - | - | - |"
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_the_tenant_table_follows_only_with_tenants_and_renders_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tables() appends the per-tenant table when records carry a tenant (and skips a lone
    criticality class); results.json keeps the tenants, so `epp bench report` redraws it."""
    plain = [result((record(0, 11.0),), warmup=10.0)]
    assert "Per tenant" not in tables(plain, {})
    results = [_saturated()]
    text = tables(results, {}, {"m": "Standard"})
    assert "Per criticality class" not in text
    assert "| epp | 24 | light | 2/2 | - | 100 | 100 | 2.80 | 33.3% | 0.2 | 33.3% |" in text
    write_results(tmp_path, results, {"criticality": {"m": "Standard"}})
    render(tmp_path)
    assert "| epp | 24 | heavy | 4/5 | 503: 1 |" in capsys.readouterr().out


def test_the_pool_file_makes_the_one_model_standard() -> None:
    """two-tenants' model is Standard in the EPP's pool file: both tenants share one band."""
    plan = generate("two-tenants", rate=5.0, duration=2.0, seed=1, params={"prompt_tokens": "8"})
    state = parse_pool_text(pool_file(plan, ["127.0.0.2"], 8000), "generated")
    assert [(m.model_name, m.criticality) for m in state.models] == [
        (plan.base_model, Criticality.STANDARD)
    ]


async def test_the_client_records_each_requests_tenant() -> None:
    """A record names the fairness id its request carried, whether it succeeded or failed;
    none without the header."""
    server = await SseServer().start()
    try:
        specs = [
            replace(completion(0), headers={FAIRNESS_HEADER: "light"}),
            replace(completion(1, prompt="fail"), headers={FAIRNESS_HEADER: "heavy"}),
            completion(2),
        ]
        records = await run_requests(server.url, specs, label="t", progress=False)
    finally:
        await server.stop()
    assert [(r.tenant, r.status) for r in records] == [("light", 200), ("heavy", 503), ("", 200)]
