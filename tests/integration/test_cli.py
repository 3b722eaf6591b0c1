"""The epp command as users run it: a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.support.pool import model, pod, pool, pool_yaml

EPP = [sys.executable, "-m", "endpoint_picker"]


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EPP, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_version() -> None:
    """epp --version prints the version."""
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("epp 0.")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--grpc-port", "x"], "invalid port value"),
        (["serve", "--drain-timeout", "5"], "invalid duration"),
        (["serve", "--secure-serving", "maybe"], "invalid boolean"),
        (["serve", "--bogus"], "unrecognized arguments"),
        (["serve"], "give --pool-file PATH, or --pool-name NAME"),
        (["serve", "--pool-file", "p.yaml", "--pool-namespace", "ns"], "are for Kubernetes"),
        (["serve", "--pool-name", "p", "--pool-group", "x.io"], "invalid choice"),
        (
            ["serve", "--pool-name", "p", "--kubeconfig", "/nonexistent/kubeconfig"],
            "cannot load Kubernetes credentials",
        ),
        (["serve", "--pool-name", "p", "--metrics-endpoint-auth", "maybe"], "invalid boolean"),
        (
            ["serve", "--pool-file", "p.yaml", "--metrics-endpoint-auth"],
            "needs --metrics-token-file",
        ),
    ],
)
def test_bad_flags_one_line_exit_2(args: list[str], message: str) -> None:
    """Bad flags print one clear line and exit 2."""
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_secure_serving_both_spellings_parse(tmp_path: Path) -> None:
    """--secure-serving false and --secure-serving=false both parse (validated via a bad pool)."""
    for args in (["--secure-serving", "false"], ["--secure-serving=false"]):
        result = run("serve", *args, "--pool-file", str(tmp_path / "missing.yaml"))
        assert result.returncode == 2
        assert "cannot read pool file" in result.stderr


def test_validate_prints_what_it_found(tmp_path: Path) -> None:
    """epp validate lists the pool, its models and its endpoints."""
    path = tmp_path / "pool.yaml"
    path.write_text(
        pool_yaml(pool(), model("chat", targets={"a": 1, "b": 3}), pod("p", "127.0.0.2"))
    )
    result = run("validate", "--pool-file", str(path))
    assert result.returncode == 0, result.stderr
    assert "InferencePool default/pool" in result.stdout
    assert "model chat: Standard, a=1, b=3" in result.stdout
    assert "endpoint 127.0.0.2:8000" in result.stdout


def test_validate_names_pods_sharing_an_address(tmp_path: Path) -> None:
    """Duplicate pod addresses are a warning on stderr (exit 0: serving takes the file and
    routes to each address once); the endpoint list and counts show each address once."""
    path = tmp_path / "pool.yaml"
    pods = (pod("a", "127.0.0.2"), pod("b", "127.0.0.3"), pod("copy-of-a", "127.0.0.2"))
    path.write_text(pool_yaml(pool(), model("m"), *pods, pod("d", "127.0.0.5", ready=False)))
    result = run("validate", "--pool-file", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("endpoint 127.0.0.2:8000") == 1
    assert "2 endpoints; 0 pods not in the pool, 1 of the pool not Ready" in result.stdout
    assert (
        "epp: warning: duplicate pod address: 127.0.0.2:8000 is the address of 2 pods: "
        "default/a (kept), default/copy-of-a"
    ) in result.stderr


def test_validate_reports_field_path(tmp_path: Path) -> None:
    """An invalid pool file names the document and field, exit 2."""
    path = tmp_path / "pool.yaml"
    path.write_text(pool_yaml(pool(), model("chat", criticality="Urgent")))
    result = run("validate", "--pool-file", str(path))
    assert result.returncode == 2
    assert 'document 2 (InferenceModel "chat"): spec.criticality' in result.stderr


def test_serve_starts_and_drains_on_sigterm(tmp_path: Path) -> None:
    """epp serve logs that it serves, and exits 0 soon after SIGTERM."""
    path = tmp_path / "pool.yaml"
    path.write_text(pool_yaml(pool(), model("m"), pod("p", "127.0.0.2")))
    proc = subprocess.Popen(
        [*EPP, "serve", "--pool-file", str(path), "--bind-address", "127.0.0.1",
         "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0",
         "--drain-timeout", "1s", "--log-format", "json"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 20
        line = ""
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if "endpoint picker serving" in line:
                break
        assert "endpoint picker serving" in line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("sglang-queue", "use ENGINE.FIELD=METRIC"),
        ("sglang.queues=sglang:x", "metric_overrides.sglang.queues"),
    ],
)
def test_bad_engine_metric_override_exit_2(tmp_path: Path, flag: str, message: str) -> None:
    """A malformed or unknown --engine-metric override is one clear line, exit 2."""
    path = tmp_path / "pool.yaml"
    path.write_text(pool_yaml(pool(), pod("p", "127.0.0.2")))
    result = run(
        "serve", "--pool-file", str(path), "--bind-address", "127.0.0.1", "--grpc-port", "0",
        "--grpc-health-port", "0", "--metrics-port", "0", "--engine-metric", flag,
    )  # fmt: skip
    assert result.returncode == 2
    assert message in result.stderr


async def test_second_signal_exits_without_waiting_for_the_drain(tmp_path: Path) -> None:
    """SIGTERM starts a 60 s drain around an open stream; a second SIGTERM ends it at once."""
    import asyncio

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from tests.support.extproc import headers
    from tests.support.model_servers import free_port

    path = tmp_path / "pool.yaml"
    path.write_text(pool_yaml(pool(), model("m"), pod("p", "127.0.0.2")))
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *EPP, "serve", "--pool-file", str(path), "--bind-address", "127.0.0.1",
        "--grpc-port", str(port), "--grpc-health-port", "0", "--metrics-port", "0",
        "--secure-serving", "false", "--drain-timeout", "60s",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        while b"endpoint picker serving" not in await proc.stderr.readline():
            assert proc.returncode is None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(headers())  # an open stream: the drain waits for it
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            assert proc.returncode is None, "still draining"
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 1
            call.cancel()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
