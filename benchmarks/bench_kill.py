"""Errors clients see when a model server is killed under load, per shipped Envoy config.

Run: .venv/bin/python benchmarks/bench_kill.py [--variants reference,fallback,buffered]
     [--rate 150] [--duration 6] [--kill-at 2] [--epp-src DIR]

Four simulated vLLM servers (`epp sim`, one process each, 127.0.0.2-5:8000, the pool of
deploy/examples/pool.yaml), `epp serve` and Envoy with the variant's rendered config. An
open-loop client sends `--rate` short completions a second (Poisson arrivals, seeded); at
`--kill-at` seconds the server on 127.0.0.2 gets SIGKILL. Reported: every non-200 answer to a
request sent after the kill, by status, and how long after the kill the last one was sent; and
the requests in flight on the killed server, which fail with it in any setup.

`--epp-src DIR` runs the EPP from another source tree (e.g. a `git worktree` of an older
commit) behind the same Envoy config, to compare before and after side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from endpoint_picker import envoy_config

REPO = Path(__file__).resolve().parents[1]

POOL_FILE = REPO / "deploy" / "examples" / "pool.yaml"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SERVERS = [f"127.0.0.{i}" for i in range(2, 6)]
PORT = 8000
EPP_PORT, EPP_HEALTH, EPP_METRICS = 9102, 9103, 9190
LISTEN, ADMIN = 8181, 19100


@dataclass
class Outcome:
    sent_at: float  # seconds since the load started
    status: int
    served_by: str


async def _wait(url: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url) as reply:
                    if reply.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"not healthy in {within:.0f}s: {url}")


async def _one(session: aiohttp.ClientSession, url: str, start: float) -> Outcome:
    sent = time.monotonic() - start
    payload = {"model": MODEL, "prompt": "Write a haiku about GPUs", "max_tokens": 16}
    try:
        async with session.post(url, json=payload) as reply:
            await reply.read()
            return Outcome(sent, reply.status, reply.headers.get("x-served-by", ""))
    except aiohttp.ClientError:
        return Outcome(sent, 0, "")  # connection-level failure


async def _load(
    url: str, rate: float, duration: float, kill_at: float, victim: int
) -> list[Outcome]:
    rng = random.Random(7)
    tasks: list[asyncio.Task[Outcome]] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=30)
    ) as session:
        start = time.monotonic()
        next_at, killed = 0.0, False
        while next_at < duration:
            now = time.monotonic() - start
            if not killed and now >= kill_at:
                os.kill(victim, signal.SIGKILL)
                killed = True
            if now < next_at:
                await asyncio.sleep(min(next_at - now, max(0.0, kill_at - now) or 1.0))
                continue
            tasks.append(asyncio.create_task(_one(session, url, start)))
            next_at += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


async def _run_variant(args: argparse.Namespace, variant: str, tmp: Path) -> dict[str, object]:
    python = sys.executable
    env = dict(os.environ)
    if args.epp_src:
        env["PYTHONPATH"] = args.epp_src
    procs: list[asyncio.subprocess.Process] = []

    async def start(*argv: str, **kw: object) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            **kw,  # type: ignore[arg-type]
        )
        procs.append(proc)
        return proc

    endpoints = [f"{s}:{PORT}" for s in SERVERS]
    config = tmp / f"envoy-{variant}.yaml"
    config.write_text(
        envoy_config.render(
            variant,
            listen_address="127.0.0.1",
            listen_port=LISTEN,
            admin_port=ADMIN,
            epp_port=EPP_PORT,
            endpoints=endpoints,
        )
    )
    envoy = shutil.which("envoy") or str(Path(python).parent / "envoy")
    try:
        sims = [
            await start(
                python, "-m", "endpoint_picker", "sim", "--servers", "1", "--address", s,
                "--port", str(PORT), "--model", MODEL, "--lora-modules", "food-review-v1",
                "food-review-v2", "--max-loras", "2",
            )
            for s in SERVERS
        ]  # fmt: skip
        fallbacks = ["--max-fallback-endpoints", "2"] if variant == "fallback" else []
        await start(
            python, "-m", "endpoint_picker", "serve", "--pool-file", str(POOL_FILE),
            "--bind-address", "127.0.0.1", "--grpc-port", str(EPP_PORT),
            "--grpc-health-port", str(EPP_HEALTH), "--metrics-port", str(EPP_METRICS),
            "--log-level", "warning", *fallbacks, env=env,
        )  # fmt: skip
        await start(envoy, "-c", str(config), "--log-level", "error", "--base-id", str(ADMIN))
        for s in SERVERS:
            await _wait(f"http://{s}:{PORT}/health")
        await _wait(f"http://127.0.0.1:{EPP_METRICS}/healthz")
        await _wait(f"http://127.0.0.1:{ADMIN}/ready")
        await asyncio.sleep(1.0)  # a few scrapes
        outcomes = await _load(
            f"http://127.0.0.1:{LISTEN}/v1/completions",
            args.rate,
            args.duration,
            args.kill_at,
            sims[0].pid,
        )
    finally:
        for proc in reversed(procs):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()
    after = [o for o in outcomes if o.sent_at >= args.kill_at]
    failed = [o for o in after if o.status != 200]
    return {
        "variant": variant,
        "requests": len(outcomes),
        "after_kill": len(after),
        "errors_after_kill": len(failed),
        "by_status": dict(Counter(o.status for o in failed)),
        "last_error_s": round(
            max((o.sent_at for o in failed), default=args.kill_at) - args.kill_at, 3
        ),
        # sent before the kill, failed: those in flight on the killed server, lost with it
        "in_flight_lost": dict(
            Counter(o.status for o in outcomes if o.sent_at < args.kill_at and o.status != 200)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="reference,fallback,buffered")
    parser.add_argument("--rate", type=float, default=150.0, help="requests a second")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of load")
    parser.add_argument("--kill-at", type=float, default=2.0, help="seconds into the load")
    parser.add_argument("--epp-src", help="run the EPP from this source tree (its src/)")
    args = parser.parse_args()
    if args.epp_src:
        args.epp_src = os.path.abspath(args.epp_src)
    with tempfile.TemporaryDirectory(prefix="bench-kill-") as tmp:
        for variant in args.variants.split(","):
            result = asyncio.run(_run_variant(args, variant, Path(tmp)))
            print(result, flush=True)


if __name__ == "__main__":
    main()
