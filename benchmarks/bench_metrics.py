"""What scraping vLLM-sized /metrics costs, and how many endpoints one process can follow.

Run: ``.venv/bin/python benchmarks/bench_metrics.py [--quick]``

1. Parse: ``parse_metrics`` on the 64 KB vLLM v1 fixture (2 data-parallel engines, histograms),
   against a general-purpose parse of the same text (prometheus_client's parser) for scale.
2. Scrape, fixed interval: a ``ScrapeManager`` with the budget off follows N endpoints at 50 ms.
   The endpoints are real aiohttp servers on 127.0.0.x in a *child process*, so this process's
   CPU (``time.process_time``) is the client's alone: HTTP fetch + parse + bookkeeping.
   Also printed: how much of that CPU the manager's own step meter sees.
3. Scrape, adaptive: 100 endpoints with the default budget (half a core): the interval the
   manager settles on and the CPU share it actually uses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "unit" / "metrics" / "fixtures" / "vllm_v1_metrics.txt"
sys.path.insert(0, str(ROOT / "src"))

from endpoint_picker.metrics.budget import UNSEEN_OVERHEAD  # noqa: E402 - after the path


# --- the child process: N aiohttp servers serving the fixture ------------------------------------
async def serve(count: int) -> None:
    from aiohttp import web

    body = FIXTURE.read_bytes()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    hostports = []
    for i in range(count):
        host = f"127.0.{1 + i // 200}.{20 + i % 200}"
        site = web.TCPSite(runner, host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        hostports.append([host, port])
    print(json.dumps(hostports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until parent exits
    await runner.cleanup()


# --- the parent: measurements --------------------------------------------------------------------
def bench_parse() -> float:
    from prometheus_client.parser import text_string_to_metric_families

    from endpoint_picker.metrics.engines import BUILTIN_ENGINES
    from endpoint_picker.metrics.parser import parse_metrics

    text = FIXTURE.read_bytes()
    names = BUILTIN_ENGINES["vllm"]

    def best(fn: object, number: int) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number  # type: ignore[arg-type]

    ours = best(lambda: parse_metrics(text, names, 0.0), 2000)
    full = best(lambda: list(text_string_to_metric_families(text.decode())), 20)
    lines = text.count(b"\n")
    print(f"payload: {len(text) / 1024:.1f} KiB, {lines} lines (vLLM v1, 2 DP engines)")
    print(f"parse_metrics:                 {ours * 1e6:8.1f} us per page")
    print(f"prometheus_client full parse:  {full * 1e6:8.1f} us per page ({full / ours:.0f}x)")
    return ours


def start_servers(count: int) -> tuple[subprocess.Popen[str], list[tuple[str, int]]]:
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    hostports = [(h, p) for h, p in json.loads(child.stdout.readline())]
    return child, hostports


async def run_manager(
    hostports: list[tuple[str, int]], *, cpu_budget: float, warmup: float, seconds: float
) -> dict[str, float]:
    from endpoint_picker.metrics.scraper import ScrapeManager
    from endpoint_picker.settings import ScrapeSettings
    from endpoint_picker.types import Endpoint, MetricsSnapshot

    scrapes = 0

    def on_snapshot(_: Endpoint, __: MetricsSnapshot) -> None:
        nonlocal scrapes
        scrapes += 1

    manager = ScrapeManager(ScrapeSettings(), on_snapshot, cpu_budget=cpu_budget)
    await manager.start()
    manager.set_endpoints(Endpoint(f"pod-{i}", "bench", h, p) for i, (h, p) in enumerate(hostports))
    await asyncio.sleep(warmup)
    scrapes, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
    intervals = []
    for _ in range(int(seconds / 0.25)):
        await asyncio.sleep(0.25)
        intervals.append(manager.interval)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    metered = manager.budget.cost_per_scrape
    await manager.stop()
    return {
        "scrapes_per_s": scrapes / wall,
        "cpu_share": cpu / wall,
        "cpu_per_scrape": cpu / max(scrapes, 1),
        "metered_per_scrape": metered,
        "interval": statistics.median(intervals),
    }


def report_fixed(count: int, result: dict[str, float], parse: float) -> float:
    per_scrape = result["cpu_per_scrape"]
    per_endpoint = per_scrape * 20  # one endpoint at 50 ms: 20 scrapes/s
    fits = 0.5 / per_endpoint
    print(f"\nfixed 50 ms, {count} endpoints (budget off), servers in a child process:")
    print(f"  scrapes/s:             {result['scrapes_per_s']:8.0f} (ideal {count * 20})")
    print(f"  client CPU:            {result['cpu_share'] * 100:8.1f} % of a core")
    print(f"  CPU per scrape:        {per_scrape * 1e6:8.0f} us (parse {parse * 1e6:.0f} us)")
    print(f"  CPU per endpoint:      {per_endpoint * 100:8.2f} % of a core at 50 ms")
    print(f"  endpoints in 0.5 core: {fits:8.0f} at 50 ms")
    seen = result["metered_per_scrape"] / UNSEEN_OVERHEAD
    print(
        f"  step meter sees:       {seen * 1e6:8.0f} us per scrape "
        f"({seen / per_scrape * 100:.0f} % of the measured CPU; x{UNSEEN_OVERHEAD} = "
        f"{result['metered_per_scrape'] / per_scrape * 100:.0f} %)"
    )
    return fits


def report_adaptive(count: int, result: dict[str, float]) -> None:
    seen = result["metered_per_scrape"] / UNSEEN_OVERHEAD
    print(f"\nadaptive, {count} endpoints, cpu_budget 0.5:")
    print(
        f"  step meter sees:       {seen / result['cpu_per_scrape'] * 100:8.0f} % of the measured"
        f" CPU per scrape ({result['cpu_per_scrape'] * 1e6:.0f} us)"
    )
    print(f"  settled interval:      {result['interval'] * 1e3:8.0f} ms")
    print(f"  scrapes/s:             {result['scrapes_per_s']:8.0f}")
    print(f"  client CPU:            {result['cpu_share'] * 100:8.1f} % of a core")


async def bench_scrape(fixed_count: int, adaptive_count: int, seconds: float) -> None:
    parse = bench_parse()
    child, hostports = start_servers(max(fixed_count, adaptive_count))
    try:
        fixed = await run_manager(
            hostports[:fixed_count], cpu_budget=0.0, warmup=1.0, seconds=seconds
        )
        report_fixed(fixed_count, fixed, parse)
        adaptive = await run_manager(
            hostports[:adaptive_count], cpu_budget=0.5, warmup=2.0, seconds=seconds
        )
        report_adaptive(adaptive_count, adaptive)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="shorter runs (smoke test)")
    parser.add_argument("--fixed", type=int, default=20, help="endpoints at a fixed 50 ms")
    parser.add_argument("--adaptive", type=int, default=100, help="endpoints under the budget")
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    asyncio.run(bench_scrape(args.fixed, args.adaptive, 2.0 if args.quick else 6.0))


if __name__ == "__main__":
    main()
