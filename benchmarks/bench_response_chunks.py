"""EPP CPU per ext_proc stream and per streamed response chunk, by gRPC stack.

Run: .venv/bin/python benchmarks/bench_response_chunks.py [--streams 400] [--chunks 1,50]
         [--servers h2,grpcio]

A streamed completion passes through the EPP chunk by chunk (FULL_DUPLEX_STREAMED): each
chunk is one message in and one out. For each ``--servers`` stack (``epp serve
--ext-proc-server``) and each chunk count, a fresh ``epp serve`` (4 pods, no scraping,
plaintext) gets ``--streams`` complete exchanges from a real gRPC client, 8 at a time: request
headers and body, response headers, then the chunks one by one, each awaited. The EPP's CPU
(``/proc/PID/stat``) per stream; the difference between two chunk counts is the cost of a chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from endpoint_picker.bench.lone import body, headers, lone_epp, response_body, response_headers
from endpoint_picker.bench.procstat import cpu_seconds

CHUNK = b'data: {"choices":[{"index":0,"text":" hello hello hello hello hello hello"}]}\n\n'
PARALLEL = 8


async def one_stream(stub: pb_grpc.ExternalProcessorStub, i: int, chunks: int) -> None:
    call = stub.Process()
    await call.write(headers())
    await call.write(body(orjson.dumps({"model": "base", "prompt": f"question {i}"})))
    await call.read()  # the routing headers
    await call.read()  # the body passed on
    await call.write(response_headers("text/event-stream"))
    await call.read()
    for k in range(chunks):
        await call.write(response_body(CHUNK, end_of_stream=k == chunks - 1))
        await call.read()
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass


async def measure(server: str, streams: int, chunks: int, folder: Path, port: int) -> float:
    """Microseconds of EPP CPU per stream."""
    async with (
        lone_epp(folder, port, server) as process,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        await asyncio.wait_for(channel.channel_ready(), 20)
        stub = pb_grpc.ExternalProcessorStub(channel)
        await asyncio.gather(*(one_stream(stub, i, chunks) for i in range(PARALLEL)))  # warm
        before = cpu_seconds(process.pid)
        for first in range(0, streams, PARALLEL):
            await asyncio.gather(*(one_stream(stub, first + k, chunks) for k in range(PARALLEL)))
        return (cpu_seconds(process.pid) - before) / streams * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=400)
    parser.add_argument("--chunks", default="1,50")
    parser.add_argument("--servers", default="h2,grpcio")
    parser.add_argument("--port", type=int, default=19_755)
    args = parser.parse_args()
    counts = [int(c) for c in args.chunks.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        for server in args.servers.split(","):
            costs = []
            for chunks in counts:
                started = time.monotonic()
                cost = asyncio.run(measure(server, args.streams, chunks, Path(folder), args.port))
                costs.append(cost)
                wall = (time.monotonic() - started) / args.streams * 1e3
                print(f"{server:8} {chunks:4} chunks: {cost:7.0f} µs CPU a stream "
                      f"({wall:.2f} ms wall a stream, startup included)", flush=True)  # fmt: skip
            if len(counts) >= 2:
                per_chunk = (costs[-1] - costs[0]) / (counts[-1] - counts[0])
                print(f"{server:8} about {per_chunk:.0f} µs CPU a chunk", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
