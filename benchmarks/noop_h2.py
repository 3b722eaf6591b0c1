"""The throughput floor of the EPP's default gRPC stack: the no-op ext_proc on the h2 server.

The same answers as benchmarks/noop_extproc.py (the grpc.aio floor of
docs/architecture.md), served by the EPP's own ext_proc server on h2 (`extproc/h2grpc.py`,
`epp serve --ext-proc-server h2`).
Run: .venv/bin/python benchmarks/noop_h2.py --port 9102 --endpoints 127.0.0.2:8000,...
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from noop_extproc import Noop

from endpoint_picker.extproc.h2grpc import H2GrpcServer
from endpoint_picker.extproc.server import ExternalProcessor, HealthState


async def serve(port: int, endpoints: list[str]) -> None:
    noop = Noop(endpoints)
    new_stream: Any = noop.new_stream  # duck-typed as the EPP's RequestStream
    health = HealthState()
    await health.start()
    await health.set_ready(True)
    server = H2GrpcServer(ExternalProcessor(new_stream), health, "127.0.0.1", port)
    await server.start()
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoints", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.endpoints.split(",")))


if __name__ == "__main__":
    main()
