"""The throughput floor of the EPP's default gRPC stack: the no-op ext_proc on grpclib.

The same answers as benchmarks/noop_extproc.py (the grpc.aio floor of DESIGN.md), served by
grpclib, the pure-Python HTTP/2 stack `epp serve` uses by default (`--ext-proc-server`).
Run: .venv/bin/python benchmarks/noop_grpclib.py --port 9102 --endpoints 127.0.0.2:8000,...
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2
from grpclib.const import Cardinality, Handler
from grpclib.server import Server, Stream
from noop_extproc import Noop

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class NoopService:
    """grpclib's servable: the grpc.aio no-op's answers, and health always SERVING."""

    def __init__(self, endpoints: list[str]) -> None:
        self._noop = Noop(endpoints)

    def __mapping__(self) -> dict[str, Handler]:
        return {
            PROCESS: Handler(
                self._process,
                Cardinality.STREAM_STREAM,
                pb.ProcessingRequest,
                pb.ProcessingResponse,
            ),
            "/grpc.health.v1.Health/Check": Handler(
                self._check,
                Cardinality.UNARY_UNARY,
                health_pb2.HealthCheckRequest,
                health_pb2.HealthCheckResponse,
            ),
        }

    async def _process(self, stream: Stream[Any, Any]) -> None:
        async for response in self._noop.Process(stream, None):
            await stream.send_message(response)

    async def _check(self, stream: Stream[Any, Any]) -> None:
        await stream.recv_message()
        await stream.send_message(
            health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        )


async def serve(port: int, endpoints: list[str]) -> None:
    server = Server([NoopService(endpoints)])
    await server.start("127.0.0.1", port)
    await server.wait_closed()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoints", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.endpoints.split(",")))


if __name__ == "__main__":
    main()
