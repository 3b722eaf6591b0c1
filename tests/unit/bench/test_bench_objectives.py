"""A latency objective in a bench run: set by a workload parameter, written into the pool file,
summarised per model (latency per output token at P95, share of requests within it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.unit.bench.builders import record, result
from tests.unit.bench.test_bench_client import SseServer, completion

from endpoint_picker.bench.client import run_requests
from endpoint_picker.bench.model import RequestRecord, WorkloadPlan
from endpoint_picker.bench.report import objective_table, render, tables, write_results
from endpoint_picker.bench.stacks import pool_file
from endpoint_picker.bench.stats import summarize_models
from endpoint_picker.bench.workloads import generate
from endpoint_picker.datastore.objects import Objective
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.types import Criticality


def _mixed(**params: str) -> WorkloadPlan:
    return generate(
        "mixed-criticality", rate=20.0, duration=5.0, seed=1,
        params={"prompt_tokens": "32", **params},
    )  # fmt: skip


def test_objective_parameter_reaches_the_epps_pool_file() -> None:
    """objective_ms gives `critical` an objective in the plan and in the generated pool file;
    without it no model has one."""
    assert _mixed().objectives == {}
    plan = _mixed(objective_ms="40")
    assert plan.objectives == {"critical": 0.04}
    state = parse_pool_text(pool_file(plan, ["127.0.0.2"], 8000), "generated")
    objectives = {m.model_name: m.objective for m in state.models}
    assert objectives["critical"] == Objective(pytest.approx(0.04))
    assert objectives["standard"] is None
    assert {m.model_name: m.criticality for m in state.models}["critical"] is Criticality.CRITICAL


def _with_model(model: str, index: int, *, e2e: float | None, out: int = 100) -> RequestRecord:
    base = record(index, float(index), e2e=e2e, out=out)
    if e2e is None:
        base = record(index, float(index), status=503, ttft=None, e2e=None, out=0)
    return RequestRecord(**{**{f: getattr(base, f) for f in base.__slots__}, "model": model})


def test_models_are_summarised_against_their_objective() -> None:
    """Per model: the P95 of e2e / output tokens, and the share of requests within the
    objective (a failed one is not); names without an objective show no share."""
    critical = [_with_model("critical", i, e2e=v) for i, v in enumerate((1.0, 2.0, 3.0, 9.0))]
    failed = _with_model("critical", 4, e2e=None)
    other = [_with_model("standard", 10 + i, e2e=5.0) for i in range(3)]
    rows = summarize_models(result((*critical, failed, *other)), {"critical": 0.025})
    assert [r.model for r in rows] == ["critical", "standard"]
    crit, std = rows
    assert (crit.sent, crit.completed) == (5, 4)
    assert crit.met == pytest.approx(2 / 5)  # 10 and 20 ms per token; 30, 90 and a 503 miss
    assert crit.per_token_p95 == pytest.approx(0.01 * (3 + 0.85 * 6))  # 3.0 to 9.0 at rank 2.85
    assert std.met is None
    assert std.per_token_p95 == pytest.approx(0.05)


def test_the_per_model_table_follows_the_main_one_only_with_objectives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tables() adds the per-model table when the plan had objectives; render reads them back."""
    results = [result((_with_model("critical", 0, e2e=2.0),), target="epp", rate=40.0)]
    assert "Per model" not in tables(results, {})
    text = tables(results, {"critical": 0.05})
    assert "| epp | 40 | critical | 50 | 1/1 | 19.2 | 20.0 | 100.0% |" in text
    assert text.startswith("| target | workload |")
    write_results(tmp_path, results, {"objectives": {"critical": 0.05}})
    render(tmp_path)
    assert "| epp | 40 | critical | 50 |" in capsys.readouterr().out
    header = objective_table([]).splitlines()[0]
    assert "latency/token p95 (ms)" in header


async def test_the_client_records_each_requests_model() -> None:
    """Each record names the model its request asked for."""
    server = await SseServer().start()
    try:
        [rec] = await run_requests(server.url, [completion(0)], label="t", progress=False)
    finally:
        await server.stop()
    assert rec.model == "m"


def test_the_criticality_table_shows_each_class_and_its_refusals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With criticality classes in the plan, a per-class table counts refusals by status and
    the TTFT of what got through; render reads the classes back from the results."""
    records = (
        _with_model("critical", 0, e2e=2.0),
        _with_model("sheddable", 1, e2e=None),  # a 503
        _with_model("sheddable", 2, e2e=1.0),
    )
    results = [result(records, target="epp", rate=40.0)]
    classes = {"critical": "Critical", "sheddable": "Sheddable"}
    assert "Per criticality class" not in tables(results, {})
    text = tables(results, {}, classes)
    assert "| epp | 40 | critical | Critical | 1/1 | - | 100 | 100 | 2.00 |" in text
    assert "| epp | 40 | sheddable | Sheddable | 1/2 | 503: 1 | 100 | 100 | 1.00 |" in text
    write_results(tmp_path, results, {"criticality": classes})
    render(tmp_path)
    assert "| sheddable | Sheddable | 1/2 | 503: 1 |" in capsys.readouterr().out
