"""`epp bench run` end to end: a few seconds of two real stacks, then the report is checked."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
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
    "oracle hit",
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
    assert len(rows) == 4  # the main table, then what the router added (Envoy's access log)
    assert all("| shared-prefix |" in row for row in rows[:2])
    assert "What the router added" in done.stdout
    assert all(
        re.match(r"\| (rr|epp) \| 4 \| \d+ \| [\d.]+ / [\d.]+ / [\d.]+ \|", r) for r in rows[2:]
    )
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


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_and_every_process_it_started(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """SIGTERM or SIGINT mid-run (also from a background shell, where SIGINT starts ignored):
    the command exits at once with 143 and leaves no simulator or Envoy behind."""
    command = [
        sys.executable, "-m", "endpoint_picker", "bench", "run", "--workload", "shared-prefix",
        "--param", "groups=2", "--param", "prompt_tokens=100", "--stack", "rr", "--rate", "2",
        "--duration", "60", "--servers", "1", "--report", str(tmp_path / "r"), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as `cmd &` does
    )
    try:
        deadline = time.monotonic() + 30
        while len(_children(proc.pid)) < 2:  # the simulator and Envoy
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the stack never started"
            time.sleep(0.2)
        started = _children(proc.pid)
        time.sleep(1.0)  # requests flowing
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr[-2000:]
    assert "stopped by a signal" in stderr
    for child in started:
        assert (
            not Path(f"/proc/{child}").exists()
            or "zombie" in Path(f"/proc/{child}/status").read_text().lower()
        ), f"child {child} still running"
