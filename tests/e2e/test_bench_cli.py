"""`epp bench run` end to end: a few seconds of two real stacks, then the report is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytestmark = pytest.mark.e2e

COLUMNS = (
    "TTFT p50 (ms)",
    "TTFT p90 (ms)",
    "TTFT p99 (ms)",
    "TPOT p50 (ms)",
    "TPOT p90 (ms)",
    "e2e p50 (s)",
    "e2e p90 (s)",
    "req/s",
    "tok/s",
    "hit rate",
    "max/mean load",
    "valid",
)


@pytest.mark.timeout(180)
def test_bench_run_rr_and_epp_writes_a_full_report(tmp_path: Path) -> None:
    """Two stacks, a handful of requests: every column, results.json and the plots exist."""
    report = tmp_path / "report"
    command = [
        sys.executable, "-m", "endpoint_picker", "bench", "run",
        "--workload", "shared-prefix", "--param", "groups=4", "--param", "prompt_tokens=300",
        "--param", "output_tokens=20", "--stack", "rr,epp", "--rate", "4", "--duration", "3",
        "--servers", "2", "--report", str(report), "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("| target"))
    for column in COLUMNS:
        assert column in header
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| rr", "| epp"))]
    assert len(rows) == 2
    results = orjson.loads((report / "results.json").read_bytes())
    assert [r["target"] for r in results["results"]] == ["rr", "epp"]
    for result in results["results"]:
        assert len(result["records"]) >= 4
        assert all(r["status"] == 200 for r in result["records"])
        assert len(result["fleet"]["servers"]) == 2
    for plot in ("latency_vs_rate.png", "requests_per_server.png", "queue_over_time.png"):
        assert (report / plot).stat().st_size > 1000
    again = subprocess.run(
        [sys.executable, "-m", "endpoint_picker", "bench", "report", str(report)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert header in again.stdout


def test_bench_without_a_target_is_a_usage_error() -> None:
    """No --stack or --url: one line and exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "endpoint_picker", "bench", "run", "--workload", "chat"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "one of the arguments --stack --url is required" in done.stderr
