"""Does the scrape CPU budget hold where it binds? Hundreds of endpoints, one ScrapeManager.

Run: .venv/bin/python benchmarks/bench_scrape_budget.py [--sizes 256,1024] [--budget 0.5]
     [--seconds 10] [--rounds 2]

For each size N: N endpoints on 127.0.x.y:18000 answered by one Envoy with the vLLM page
(filtered by ``name[]`` as vLLM filters it; ``endpoint_picker.bench.fleetenvoy``), and in this
process a ``ScrapeManager`` asked for 50 ms with ``--budget`` of a core (what ``epp serve``
does). After a warm-up, printed: scrapes a second, the interval the manager settled on, the
CPU this process really used (``time.process_time``: nothing else runs in it) and what the
budget estimated (its per-scrape cost, which scales the metered CPU by
``budget.UNSEEN_OVERHEAD``). With ``--fixed``, the budget is off and the interval is
``--fixed`` seconds: the real cost per scrape at that rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

from endpoint_picker.bench.fleetenvoy import addresses, backend_fleet, default_envoy
from endpoint_picker.metrics.scraper import ScrapeManager
from endpoint_picker.settings import ScrapeSettings
from endpoint_picker.types import Endpoint, MetricsSnapshot

METRICS_PAGE = (
    Path(__file__).resolve().parents[1] / "tests/unit/metrics/fixtures/vllm_v1_metrics.txt"
)


async def measure(count: int, args: argparse.Namespace) -> str:
    scrapes = 0

    def on_snapshot(endpoint: Endpoint, snapshot: MetricsSnapshot) -> None:
        nonlocal scrapes
        scrapes += 1

    fixed = args.fixed > 0
    settings = ScrapeSettings(refresh_interval=args.fixed if fixed else 0.05)
    manager = ScrapeManager(settings, on_snapshot, cpu_budget=0.0 if fixed else args.budget)
    endpoints = []
    for i, hostport in enumerate(addresses(count, args.first_subnet)):
        host, port = hostport.rsplit(":", 1)
        endpoints.append(Endpoint(f"pod-{i}", "ns", host, int(port)))
    manager.set_endpoints(endpoints)
    await manager.start()
    try:
        await asyncio.sleep(args.warmup)
        if args.announce:
            print(f"scraping {count} endpoints, warmed up", flush=True)
        cpu, wall, seen = time.process_time(), time.monotonic(), scrapes
        await asyncio.sleep(args.seconds)
        cpu, wall, seen = time.process_time() - cpu, time.monotonic() - wall, scrapes - seen
        interval = manager.interval
    finally:
        await manager.stop()
    real = cpu / max(seen, 1)
    estimate = manager.budget.cost_per_scrape
    return (
        f"{count:6d} endpoints  {seen / wall:6.0f} scrapes/s  interval {interval * 1e3:4.0f}"
        f" ms  CPU {cpu / wall * 100:5.1f}% of a core  {real * 1e6:4.0f} us/scrape  budget's"
        f" estimate {estimate * 1e6:4.0f} us ({estimate / real:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--budget", type=float, default=0.5, help="a fraction of one core")
    parser.add_argument("--fixed", type=float, default=0.0, help="budget off, this interval")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--first-subnet", type=int, default=1, help="endpoints on 127.0.N.2 up")
    parser.add_argument("--announce", action="store_true", help="say when each warm-up is done")
    parser.add_argument("--envoy", default=default_envoy())
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with (
        tempfile.TemporaryDirectory() as tmp,
        backend_fleet(
            args.envoy,
            addresses(max(sizes), args.first_subnet),
            Path(tmp),
            METRICS_PAGE.read_text(),
            within=120,
        ),
    ):
        for _ in range(args.rounds):
            for size in sizes:
                print(asyncio.run(measure(size, args)), flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C, or the end of a run beside another
        main()
