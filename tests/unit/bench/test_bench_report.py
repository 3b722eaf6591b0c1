"""results.json round trip, the markdown table and the PNG plots, from small synthetic results."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tests.unit.bench.builders import record, result, server, steady

from endpoint_picker.bench.model import BenchError, TargetResult
from endpoint_picker.bench.report import (
    RESULTS_FILE,
    load_results,
    markdown_table,
    render,
    write_plots,
    write_results,
)
from endpoint_picker.bench.stats import summarize


def _results() -> list[TargetResult]:
    """Two targets at two rates; epp at the higher rate ran late (invalid)."""
    out = []
    for rate in (5.0, 10.0):
        for target, counts in (("rr", (10, 10)), ("epp", (14, 6))):
            late = 0.9 if (target, rate) == ("epp", 10.0) else 0.1
            servers = tuple(
                server(f"127.0.0.{i + 2}:8000", n, queries=100, hits=40, planned=10, late=late,
                       behind=0.0, waiting=(0, i + 1, 2))
                for i, n in enumerate(counts)
            )  # fmt: skip
            out.append(result(steady(), servers, target=target, rate=rate, notes=("a note",)))
    return out


def test_results_json_round_trips(tmp_path: Path) -> None:
    """write_results then load_results gives back equal results and the meta (Paths as str)."""
    results = [*_results(), result((record(3, 1.0, status=0, ttft=None, e2e=None, error="x"),))]
    meta = {"argv": ["epp", "bench", "run"], "params": {"seed": 1}, "dir": tmp_path}
    path = write_results(tmp_path / "out", results, meta)
    assert path.name == RESULTS_FILE
    loaded, loaded_meta = load_results(tmp_path / "out")
    assert loaded == results
    assert loaded_meta == {**meta, "dir": str(tmp_path)}


def test_reply_texts_are_not_kept(tmp_path: Path) -> None:
    """Reply texts only feed later chat turns, so results.json leaves them out."""
    with_text = result((replace(record(), reply_text="hello"),))
    write_results(tmp_path, [with_text], {})
    assert b"hello" not in (tmp_path / RESULTS_FILE).read_bytes()
    assert load_results(tmp_path)[0][0].records[0].reply_text == ""


@pytest.mark.parametrize("content", [b"not json", b'{"version": 99, "meta": {}, "results": []}'])
def test_unreadable_results_are_a_bench_error(tmp_path: Path, content: bytes) -> None:
    """A broken or foreign results.json is reported as a BenchError, not a traceback."""
    (tmp_path / RESULTS_FILE).write_bytes(content)
    with pytest.raises(BenchError):
        load_results(tmp_path)


def test_markdown_table_has_every_column_and_row() -> None:
    """One row per target x rate with every column, and the invalid row's reason below."""
    table = markdown_table([summarize(r) for r in _results()])
    header = table.splitlines()[0]
    for column in ("TTFT p50 (ms)", "TTFT p90 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)",
                   "TPOT p90 (ms)", "e2e p50 (s)", "e2e p90 (s)", "req/s", "tok/s", "hit rate",
                   "oracle hit", "max/mean load", "valid"):  # fmt: skip
        assert f"| {column} |" in header
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    assert len(rows) == 4
    assert all(row.count("|") == header.count("|") for row in rows)
    assert "| 40% | - | 1.40 | **no** |" in rows[3]  # epp at 10: hits 80/200, load 14/10
    assert "- epp at 10 req/s: simulated fleet ran late" in table


def test_plots_are_written(tmp_path: Path) -> None:
    """write_plots draws the three PNGs, non-empty, from a small synthetic result."""
    paths = write_plots(tmp_path, _results())
    names = {p.name for p in paths}
    assert names == {"latency_vs_rate.png", "requests_per_server.png", "queue_over_time.png"}
    for path in paths:
        assert path.read_bytes().startswith(b"\x89PNG")
        assert path.stat().st_size > 1000


def test_plots_of_nothing_are_still_written(tmp_path: Path) -> None:
    """No results (every target failed to start): empty plots, no error or warning."""
    assert all(path.exists() for path in write_plots(tmp_path, []))


def test_render_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """render (epp bench report DIR) reloads results.json and prints the table."""
    write_results(tmp_path, _results()[:1], {})
    render(tmp_path)
    assert "| rr | shared-prefix | 5 | 11/11 |" in capsys.readouterr().out
    assert (tmp_path / "queue_over_time.png").exists()
