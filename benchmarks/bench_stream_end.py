"""How an ext_proc stream ends decides whether the EPP's memory grows: RSS per stream, by ending.

Run: .venv/bin/python benchmarks/bench_stream_end.py [--streams 60000] [--endings clean,envoy,late]
         [--servers h2,grpcio]   (the EPP's --ext-proc-server stacks, each measured)
         [--progress N]          (the RSS every N streams)

An ``epp serve`` process (a pool of 4 pods, no scraping, plaintext gRPC) gets ``--streams``
complete ext_proc exchanges (request headers and body, then response headers and body, 8 at a
time) from a real gRPC client, which ends each stream one of these ways:

- ``clean``: half-close, then read until the EPP's status (what Envoy does with the runtime guard
  ``envoy.reloadable_features.ext_proc_graceful_grpc_close``, which the shipped configs set);
- ``envoy``: half-close and reset at once (Envoy's default: ``closeStream`` then ``resetStream``);
- ``late``: the same, 5 ms after the last response, when the EPP's status has gone out;
- ``reset``: reset without a half-close.

The EPP's RSS (``/proc/PID/status`` VmRSS) is read every 2,000 streams; the figure is the
growth per stream after the first 4,000 (warm-up). A reset stream leaks the ``grpc_op`` arrays
of its failed or abandoned batches in grpcio's aio server (grpc/grpc#43360), which no Python
heap profiler sees. Each ending runs on a fresh EPP process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from endpoint_picker.bench.lone import body, headers, lone_epp, response_body, response_headers
from endpoint_picker.bench.procstat import rss_mib

ENDINGS = ("clean", "envoy", "late", "reset")
BATCH = 2_000
WARMUP = 4_000


async def one_stream(stub: pb_grpc.ExternalProcessorStub, i: int, ending: str) -> None:
    call = stub.Process()
    await call.write(headers())
    # one shared prefix and a unique tail shorter than a block: the prefix index stays small
    await call.write(body(orjson.dumps({"model": "base", "prompt": "hello " * 100 + str(i)})))
    async for reply in call:
        if reply.HasField("request_body") or reply.HasField("immediate_response"):
            break
    await call.write(response_headers("application/json"))
    usage = b'{"usage": {"prompt_tokens": 5, "completion_tokens": 7}}'
    await call.write(response_body(usage, end_of_stream=True))
    async for reply in call:
        if reply.HasField("response_body"):
            break
    if ending == "late":
        await asyncio.sleep(0.005)
    if ending == "clean":
        await call.done_writing()
        async for _ in call:
            pass
    elif ending in ("envoy", "late"):
        await call.done_writing()
        call.cancel()
    else:
        call.cancel()


async def measure(
    ending: str, streams: int, folder: Path, port: int, server: str, progress: int = 0
) -> float:
    """Bytes of RSS growth per stream after the warm-up, on a fresh EPP."""
    async with (
        lone_epp(folder, port, server, criticality="Critical") as process,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        await asyncio.wait_for(channel.channel_ready(), 20)
        stub = pb_grpc.ExternalProcessorStub(channel)
        gate = asyncio.Semaphore(8)

        async def guarded(i: int) -> None:
            async with gate:
                try:
                    await one_stream(stub, i, ending)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.CANCELLED:
                        raise

        done, base = 0, 0.0
        while done < streams:
            await asyncio.gather(*(guarded(done + k) for k in range(BATCH)))
            done += BATCH
            await asyncio.sleep(0.3)
            if done == WARMUP:
                base = rss_mib(process.pid)
            if progress and done % progress == 0:
                print(f"  {done:7d} streams: RSS {rss_mib(process.pid):.1f} MiB", flush=True)
        return (rss_mib(process.pid) - base) * 1024 * 1024 / (done - WARMUP)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=60_000)
    parser.add_argument("--endings", default="clean,envoy,late")
    parser.add_argument("--port", type=int, default=19_555)
    parser.add_argument(
        "--servers", default="h2,grpcio", help="the EPP's --ext-proc-server stacks to measure"
    )
    parser.add_argument(
        "--progress", type=int, default=0, metavar="N", help="print the RSS every N streams"
    )
    args = parser.parse_args()
    endings = [e for e in args.endings.split(",") if e]
    if unknown := [e for e in endings if e not in ENDINGS]:
        parser.error(f"unknown endings {unknown}; known: {', '.join(ENDINGS)}")
    if args.streams <= WARMUP:
        parser.error(f"--streams must be above the {WARMUP} warm-up streams")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory() as folder:
        for server in args.servers.split(","):
            for ending in endings:
                growth = asyncio.run(
                    measure(ending, args.streams, Path(folder), args.port, server, args.progress)
                )
                print(f"{server:7} {ending:6} {growth:6.0f} bytes of RSS per stream", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
