"""What scraping vLLM-sized /metrics costs, and how many endpoints one process can follow.

Run: ``.venv/bin/python benchmarks/bench_metrics.py [--quick]``

1. Parse: ``parse_metrics`` on the 64 KB vLLM v1 fixture (2 data-parallel engines, histograms),
   against a general-purpose parse of the same text (prometheus_client's parser) for scale.
2. Scrape, fixed interval: a ``ScrapeManager`` with the budget off follows N endpoints at 50 ms.
   The endpoints are real aiohttp servers on 127.0.0.x in a *child process*, so this process's
   CPU (``time.process_time``) is the client's alone: HTTP fetch + parse + bookkeeping.
   Also printed: how much of that CPU the manager's own step meter sees.
   For comparison, the same loop with the former client (one aiohttp session, same options).
   And the clients alone: back-to-back GETs on one kept-alive connection, no parse, user and
   kernel CPU apart (the kernel part is the loopback TCP exchange, the same for both).
3. Scrape, adaptive: 100 endpoints with the default budget (half a core): the interval the
   manager settles on and the CPU share it actually uses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path
from typing import Any

from endpoint_picker.metrics.budget import UNSEEN_OVERHEAD

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "unit" / "metrics" / "fixtures" / "vllm_v1_metrics.txt"  # data


# --- the child process: N aiohttp servers serving the fixture ------------------------------------
async def serve(count: int) -> None:
    from aiohttp import web

    from endpoint_picker_sim.metrics import restrict

    text = FIXTURE.read_text()
    pages: dict[tuple[str, ...], bytes] = {(): text.encode()}

    async def metrics(request: web.Request) -> web.Response:
        names = tuple(request.query.getall("name[]", []))  # as prometheus_client (vLLM) does
        body = pages.get(names)
        if body is None:
            body = pages[names] = restrict(text, names).encode()
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

    from endpoint_picker_sim.metrics import restrict

    ours = best(lambda: parse_metrics(text, names, 0.0), 2000)
    hints: dict[bytes, int] = {}  # as the scraper keeps them per endpoint
    hinted = best(lambda: parse_metrics(text, names, 0.0, hints), 2000)
    full = best(lambda: list(text_string_to_metric_families(text.decode())), 20)
    small = restrict(text.decode(), names.metric_names()).encode()
    filtered_hints: dict[bytes, int] = {}
    filtered = best(lambda: parse_metrics(small, names, 0.0, filtered_hints), 2000)
    lines = text.count(b"\n")
    print(f"payload: {len(text) / 1024:.1f} KiB, {lines} lines (vLLM v1, 2 DP engines)")
    print(f"parse_metrics:                 {ours * 1e6:8.1f} us per page")
    print(f"  with the last page's hints:  {hinted * 1e6:8.1f} us per page (as scraping runs)")
    print(f"prometheus_client full parse:  {full * 1e6:8.1f} us per page ({full / ours:.0f}x)")
    print(
        f"the filtered page ({len(small) / 1024:.1f} KiB, name[]=...): "
        f"{filtered * 1e6:.1f} us per page"
    )
    return ours


def bench_render() -> None:
    """What rendering the page costs the model server: prometheus_client (vLLM's /metrics)
    with the fixture's families and values, whole and restricted to the EPP's names."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from endpoint_picker.metrics.engines import BUILTIN_ENGINES

    registry = CollectorRegistry()
    for family in text_string_to_metric_families(FIXTURE.read_text()):
        series: dict[tuple[tuple[str, str], ...], list[Any]] = {}
        for sample in family.samples:
            key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            series.setdefault(key, []).append(sample)
        labelnames = sorted({k for key in series for k, _ in key})
        if family.type == "histogram":
            bounds = sorted(
                {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
                - {float("inf")}
            )
            if not bounds:  # a histogram with only +Inf: prometheus_client will not make one
                continue
            metric: Any = Histogram(family.name, family.documentation, labelnames,
                                    buckets=bounds, registry=registry)  # fmt: skip
        elif family.type == "counter":
            metric = Counter(family.name, family.documentation, labelnames, registry=registry)
        else:
            metric = Gauge(family.name, family.documentation, labelnames, registry=registry)
        for key, samples in series.items():
            child = metric.labels(**dict(key)) if labelnames else metric
            for sample in samples:
                if family.type == "histogram" and sample.name.endswith("_sum"):
                    child._sum.set(sample.value)  # values as on the page (private API)
                elif family.type == "histogram" and sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    if le != float("inf"):
                        child._buckets[bounds.index(le)].set(sample.value)
                elif family.type == "counter" and sample.name.endswith("_total"):
                    child.inc(sample.value)
                elif family.type not in ("histogram", "counter"):
                    child.set(sample.value)
    restricted = registry.restricted_registry(BUILTIN_ENGINES["vllm"].metric_names())
    whole = generate_latest(registry)
    small = generate_latest(restricted)
    t_whole = min(timeit.repeat(lambda: generate_latest(registry), number=50, repeat=5)) / 50
    t_small = min(timeit.repeat(lambda: generate_latest(restricted), number=500, repeat=5)) / 500
    print("\nthe model server's side: prometheus_client renders the fixture's families")
    print(f"  whole page:     {t_whole * 1e6:8.0f} us ({len(whole) / 1024:.1f} KiB)")
    print(f"  name[] filter:  {t_small * 1e6:8.0f} us ({len(small) / 1024:.1f} KiB)")
    print(f"  at 20 scrapes/s: {t_whole * 2000:.1f} % of a core against {t_small * 2000:.2f} %")


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
    hostports: list[tuple[str, int]],
    *,
    cpu_budget: float,
    warmup: float,
    seconds: float,
    name_filter: bool = True,
) -> dict[str, float]:
    from endpoint_picker.metrics.scraper import ScrapeManager
    from endpoint_picker.settings import ScrapeSettings
    from endpoint_picker.types import Endpoint, MetricsSnapshot

    scrapes = 0

    def on_snapshot(_: Endpoint, __: MetricsSnapshot) -> None:
        nonlocal scrapes
        scrapes += 1

    manager = ScrapeManager(ScrapeSettings(name_filter=name_filter), on_snapshot,
                            cpu_budget=cpu_budget)  # fmt: skip
    await manager.start()
    manager.set_endpoints(Endpoint(f"pod-{i}", "bench", h, p) for i, (h, p) in enumerate(hostports))
    await asyncio.sleep(warmup)
    scrapes, cpu0, sys0, wall0 = 0, time.process_time(), os.times().system, time.perf_counter()
    intervals = []
    for _ in range(int(seconds / 0.25)):
        await asyncio.sleep(0.25)
        intervals.append(manager.interval)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    kernel = os.times().system - sys0
    metered = manager.budget.cost_per_scrape
    await manager.stop()
    return {
        "scrapes_per_s": scrapes / wall,
        "cpu_share": cpu / wall,
        "cpu_per_scrape": cpu / max(scrapes, 1),
        "kernel_share": kernel / cpu,
        "metered_per_scrape": metered,
        "interval": statistics.median(intervals),
    }


async def run_aiohttp(
    hostports: list[tuple[str, int]], *, warmup: float, seconds: float
) -> dict[str, float]:
    """The former scrape path: a shared aiohttp session, fetch + parse every 50 ms per endpoint."""
    import aiohttp

    from endpoint_picker.metrics.engines import BUILTIN_ENGINES
    from endpoint_picker.metrics.parser import parse_metrics

    names = BUILTIN_ENGINES["vllm"]
    scrapes = 0

    async def loop_one(session: aiohttp.ClientSession, url: str) -> None:
        nonlocal scrapes
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0.05 * (hash(url) % 100) / 100)
        while True:
            started = loop.time()
            async with session.get(url, allow_redirects=False) as response:
                body = await response.read()
            parse_metrics(body, names, loop.time())
            scrapes += 1
            await asyncio.sleep(max(0.0, started + 0.05 - loop.time()))

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
        cookie_jar=aiohttp.DummyCookieJar(),
        read_bufsize=1 << 18,
        timeout=aiohttp.ClientTimeout(total=1.0),
        headers={"Accept": "text/plain", "Accept-Encoding": "identity"},
    )
    tasks = [
        asyncio.create_task(loop_one(session, f"http://{h}:{p}/metrics")) for h, p in hostports
    ]
    await asyncio.sleep(warmup)
    scrapes, cpu0, sys0, wall0 = 0, time.process_time(), os.times().system, time.perf_counter()
    await asyncio.sleep(seconds)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    kernel = os.times().system - sys0
    done = scrapes
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await session.close()
    return {
        "scrapes_per_s": done / wall,
        "cpu_share": cpu / wall,
        "cpu_per_scrape": cpu / done,
        "kernel_share": kernel / cpu,
    }


async def bench_clients(host: str, port: int, gets: int = 2000) -> None:
    """CPU per GET of each client alone, user and kernel (os.times), one connection, no parse."""
    import aiohttp

    from endpoint_picker.metrics.http import HttpClient

    ours = HttpClient(host, port, timeout=1.0)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        read_bufsize=1 << 18,
        headers={"Accept": "text/plain", "Accept-Encoding": "identity"},
    )

    async def former() -> bytes:
        async with session.get(f"http://{host}:{port}/metrics") as response:
            return await response.read()

    print(f"\nclients alone, {gets} back-to-back GETs on one connection (no parse):")
    try:
        for name, get in (("HttpClient", ours.get), ("aiohttp", former)):
            for _ in range(100):
                await get()
            before = os.times()
            for _ in range(gets):
                await get()
            after = os.times()
            user = (after.user - before.user) / gets
            kernel = (after.system - before.system) / gets
            print(f"  {name:11s} user {user * 1e6:5.0f} us + kernel {kernel * 1e6:5.0f} us per GET")
    finally:
        ours.close()
        await session.close()


def report_fixed(count: int, result: dict[str, float], parse: float, what: str) -> float:
    per_scrape = result["cpu_per_scrape"]
    per_endpoint = per_scrape * 20  # one endpoint at 50 ms: 20 scrapes/s
    fits = 0.5 / per_endpoint
    print(f"\nfixed 50 ms, {count} endpoints (budget off), {what}, servers in a child process:")
    print(f"  scrapes/s:             {result['scrapes_per_s']:8.0f} (ideal {count * 20})")
    print(f"  client CPU:            {result['cpu_share'] * 100:8.1f} % of a core")
    print(
        f"  CPU per scrape:        {per_scrape * 1e6:8.0f} us (parse {parse * 1e6:.0f} us;"
        f" {result['kernel_share'] * 100:.0f} % in the kernel)"
    )
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


def report_aiohttp(count: int, result: dict[str, float], ours: float) -> None:
    per_scrape = result["cpu_per_scrape"]
    print(f"\nsame with the former aiohttp client, {count} endpoints at 50 ms:")
    print(f"  scrapes/s:             {result['scrapes_per_s']:8.0f} (ideal {count * 20})")
    print(f"  client CPU:            {result['cpu_share'] * 100:8.1f} % of a core")
    print(
        f"  CPU per scrape:        {per_scrape * 1e6:8.0f} us ({per_scrape / ours:.1f}x ours;"
        f" {result['kernel_share'] * 100:.0f} % in the kernel)"
    )
    print(f"  endpoints in 0.5 core: {0.5 / (per_scrape * 20):8.0f} at 50 ms")


async def bench_scrape(
    fixed_count: int, adaptive_count: int, seconds: float, *, compare: bool, rounds: int
) -> None:
    parse = bench_parse()
    bench_render()
    child, hostports = start_servers(max(fixed_count, adaptive_count))
    try:
        await bench_clients(*hostports[0])
        for _ in range(rounds):  # alternated: the machine drifts
            for name_filter in (True, False):
                fixed = await run_manager(
                    hostports[:fixed_count], cpu_budget=0.0, warmup=1.0, seconds=seconds,
                    name_filter=name_filter,
                )  # fmt: skip
                what = "name[] filter" if name_filter else "whole page"
                report_fixed(fixed_count, fixed, parse, what)
        if compare:
            former = await run_aiohttp(hostports[:fixed_count], warmup=1.0, seconds=seconds)
            report_aiohttp(fixed_count, former, fixed["cpu_per_scrape"])
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
    parser.add_argument("--no-aiohttp", action="store_true", help="skip the aiohttp comparison")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of filter/whole")
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    seconds = 2.0 if args.quick else 6.0
    asyncio.run(
        bench_scrape(
            args.fixed, args.adaptive, seconds, compare=not args.no_aiohttp, rounds=args.rounds
        )
    )


if __name__ == "__main__":
    main()
