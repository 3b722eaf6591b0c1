"""A lone ``epp serve`` for the benchmarks that drive it with their own gRPC client: 4 pods,
no scraping, plaintext, on ``port`` (health and metrics on the next two ports)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from tests.support.pool import model, pod, pool, pool_yaml


@contextlib.asynccontextmanager
async def lone_epp(
    folder: Path, port: int, server: str, *, criticality: str | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """The running process, terminated on exit; ``server`` is its ``--ext-proc-server``."""
    pool_file = folder / "pool.yaml"
    pods = [pod(f"p{i}", f"127.0.9.{i + 2}") for i in range(4)]
    base = model("base", criticality=criticality) if criticality else model("base")
    pool_file.write_text(pool_yaml(pool(port=8000), base, *pods))
    argv = [sys.executable, "-m", "endpoint_picker", "serve", "--pool-file", str(pool_file),
            "--grpc-port", str(port), "--grpc-health-port", str(port + 1),
            "--metrics-port", str(port + 2), "--refresh-metrics-interval", "1h",
            "--secure-serving", "false", "--log-level", "error",
            "--ext-proc-server", server]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*argv)
    try:
        yield process
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 10)
