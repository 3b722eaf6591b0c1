"""``make run``: Envoy, the EPP and a simulated vLLM fleet on one machine, from one pool file.

Starts the three as child processes, waits until each is healthy, prints curl lines that go
through Envoy, and stops them all on Ctrl-C (SIGTERM first, SIGKILL after a grace period).
Each piece can also be started alone with the same files: ``epp sim``, ``epp serve``,
``epp envoy-config``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from endpoint_picker import envoy_config

REPO = Path(__file__).resolve().parents[2]
POOL_FILE = REPO / "deploy" / "examples" / "pool.yaml"
BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ADAPTERS = ("food-review-v1", "food-review-v2")
STOP_GRACE = 10.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="make run", description=__doc__)
    p.add_argument(
        "--servers", type=int, default=4, help="simulated vLLM servers (pool file has 4)"
    )
    p.add_argument("--listen-port", type=int, default=8081, help="Envoy's port for clients")
    p.add_argument("--admin-port", type=int, default=19000, help="Envoy's admin port")
    p.add_argument("--variant", choices=envoy_config.VARIANTS, default="reference")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulator clock speed")
    return p


class Fleet:
    """The child processes, stopped in reverse order of start."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, asyncio.subprocess.Process]] = []

    async def start(self, name: str, *argv: str) -> None:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL)
        self.procs.append((name, proc))

    def dead(self) -> str | None:
        for name, proc in self.procs:
            if proc.returncode is not None:
                return f"{name} exited with status {proc.returncode}"
        return None

    async def stop(self) -> None:
        """Envoy first, then the EPP, then the fleet: nothing sees its upstream vanish early."""
        for _, proc in reversed(self.procs):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


async def _wait_healthy(fleet: Fleet, urls: Sequence[str], within: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    timeout = aiohttp.ClientTimeout(total=1.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for url in urls:
            while True:
                if (problem := fleet.dead()) is not None:
                    raise RuntimeError(problem)
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url) as reply:
                        if reply.status == 200:
                            break
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"not healthy within {within:.0f}s: {url}")
                await asyncio.sleep(0.2)


def _curl_lines(port: int) -> str:
    url = f"http://127.0.0.1:{port}"
    return f"""
Ready. Try (Envoy on :{port}, EPP metrics on :9090/metrics, Ctrl-C stops everything):

  # the EPP's live status page: open http://127.0.0.1:9090/ in a browser, or as JSON:
  curl -s http://127.0.0.1:9090/api/status

  # a completion of the base model (Critical)
  curl -s {url}/v1/completions -H 'content-type: application/json' \\
    -d '{{"model": "{BASE_MODEL}", "prompt": "Write a haiku about GPUs", "max_tokens": 30}}'

  # chat
  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{BASE_MODEL}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  # streaming (server-sent events, chunk by chunk)
  curl -sN {url}/v1/completions -H 'content-type: application/json' \\
    -d '{{"model": "{BASE_MODEL}", "prompt": "Count to ten", "max_tokens": 40, "stream": true}}'

  # the split model: 80% food-review-v1, 20% food-review-v2 (see "model" in the answer)
  curl -s {url}/v1/completions -H 'content-type: application/json' \\
    -d '{{"model": "food-review", "prompt": "The pasta was", "max_tokens": 20}}'

  # an unknown model: 404 from the EPP
  curl -s {url}/v1/completions -H 'content-type: application/json' \\
    -d '{{"model": "nope", "prompt": "hi"}}'
"""


async def run(args: argparse.Namespace) -> int:
    envoy = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    epp = [sys.executable, "-m", "endpoint_picker"]
    endpoints = [f"127.0.0.{i + 2}:8000" for i in range(args.servers)]
    fleet = Fleet()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with tempfile.TemporaryDirectory(prefix="epp-run-") as tmp:
        config = Path(tmp) / "envoy.yaml"
        config.write_text(
            envoy_config.render(
                args.variant,
                listen_address="127.0.0.1",
                listen_port=args.listen_port,
                admin_port=args.admin_port,
                epp_port=9002,
                endpoints=endpoints,
            )
        )
        try:
            await fleet.start(
                "epp sim", *epp, "sim", "--servers", str(args.servers), "--address", "127.0.0.2",
                "--port", "8000", "--model", BASE_MODEL, "--lora-modules", *ADAPTERS,
                "--max-loras", "2", "--time-scale", str(args.time_scale),
            )  # fmt: skip
            await fleet.start(
                "epp serve", *epp, "serve", "--pool-file", str(POOL_FILE),
                "--bind-address", "127.0.0.1", "--grpc-port", "9002",
                "--grpc-health-port", "9003", "--metrics-port", "9090",
            )  # fmt: skip
            await fleet.start(
                "envoy", envoy, "-c", str(config), "--log-level", "warn",
                "--base-id", str(args.admin_port),
            )  # fmt: skip
            await _wait_healthy(
                fleet,
                [f"http://{e}/health" for e in endpoints]
                + ["http://127.0.0.1:9090/healthz", f"http://127.0.0.1:{args.admin_port}/ready"],
            )
            print(_curl_lines(args.listen_port), flush=True)
            while not stop.is_set():
                if (problem := fleet.dead()) is not None:
                    print(f"make run: {problem}; stopping", file=sys.stderr)
                    return 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
            return 0
        except RuntimeError as exc:
            print(f"make run: {exc}", file=sys.stderr)
            return 1
        finally:
            print("stopping...", file=sys.stderr)
            await fleet.stop()


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(run(_parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
