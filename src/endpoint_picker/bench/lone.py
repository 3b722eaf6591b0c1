"""The EPP alone, driven over ext_proc without Envoy: the messages Envoy sends, a pool file,
and a lone ``epp serve`` process.

For the benchmarks that measure the EPP by itself (``benchmarks/bench_stream.py``: the state
machine in process; ``bench_stream_end.py``, ``bench_response_chunks.py`` and
``bench_pool_size.py``: a real gRPC client against ``epp serve``). The messages are those of
Envoy's full-duplex streamed mode, the shipped configs' (``deploy/envoy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from endpoint_picker.bench.pods import pool_file_text

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
LONE_ADDRESSES = tuple(f"127.0.9.{i + 2}" for i in range(4))  # never answer: nothing scrapes
_LABELS = {"app": "vllm"}


def _header_map(values: Mapping[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    )


def headers(
    path: str = "/v1/completions", extra: Mapping[str, str] | None = None
) -> pb.ProcessingRequest:
    """A POST's request headers (and ``extra``), with the full-duplex body modes Envoy announces."""
    values = {":path": path, ":method": "POST", ":authority": "gw", **(extra or {})}
    message = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_header_map(values)))
    message.protocol_config.request_body_mode = FULL_DUPLEX
    message.protocol_config.response_body_mode = FULL_DUPLEX
    return message


def body(chunk: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def response_headers(content_type: str = "application/json") -> pb.ProcessingRequest:
    values = {":status": "200", "content-type": content_type}
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_header_map(values)))


def response_body(chunk: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def pool_text(
    addresses: Sequence[str],
    model: str = "base",
    *,
    port: int = 8000,
    criticality: str | None = None,
    targets: Mapping[str, int] | None = None,
) -> str:
    """A pool file: an InferencePool on ``port``, one InferenceModel ``model`` (with its
    ``criticality`` and traffic split ``targets`` if given), a Ready Pod per address."""
    spec: dict[str, Any] = {"modelName": model}
    if criticality:
        spec["criticality"] = criticality
    if targets:
        spec["targetModels"] = [{"name": n, "weight": w} for n, w in targets.items()]
    return pool_file_text("pool", _LABELS, port, {"model": spec}, addresses, "p")


@contextlib.asynccontextmanager
async def lone_epp(
    folder: Path,
    port: int,
    server: str,
    *,
    criticality: str | None = None,
    side_ports: tuple[int, int] | None = None,
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A running ``epp serve`` (4 pods that are never scraped, plaintext, model ``base``) on
    127.0.0.1:``port``, health and metrics on ``side_ports`` (default: the next two ports),
    ``--ext-proc-server server``; terminated on exit."""
    health, metrics = side_ports or (port + 1, port + 2)
    pool_file = folder / "pool.yaml"
    pool_file.write_text(pool_text(LONE_ADDRESSES, criticality=criticality))
    argv = [sys.executable, "-m", "endpoint_picker", "serve", "--pool-file", str(pool_file),
            "--bind-address", "127.0.0.1", "--grpc-port", str(port),
            "--grpc-health-port", str(health), "--metrics-port", str(metrics),
            "--refresh-metrics-interval", "1h",
            "--secure-serving", "false", "--log-level", "error",
            "--ext-proc-server", server]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*argv)
    try:
        yield process
    finally:
        if process.returncode is None:  # it may have exited on its own (a port taken: exit 2)
            process.terminate()
        await asyncio.wait_for(process.wait(), 10)
