"""``epp bench run``: every target at every rate, the same seeded workload, one report.

For each rate the workload is generated once, so every target sees the same requests at the
same times. Targets run one after another, each on a fresh stack with cold caches (or the
user's ``--url``), in the order given, rate by rate: this machine drifts over minutes, so the
targets of one rate are measured side by side rather than one target at every rate first.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

import endpoint_picker.bench.client as client
import endpoint_picker.bench.envoytiming as envoytiming
import endpoint_picker.bench.report as report
import endpoint_picker.bench.stats as stats
import endpoint_picker.bench.workloads as workloads
from endpoint_picker.bench.fleet import FleetOptions
from endpoint_picker.bench.fleetwatch import FleetWatch
from endpoint_picker.bench.model import BenchError, FleetObservation, TargetResult, WorkloadPlan
from endpoint_picker.bench.stacks import StackSpec, check_fleet, running_stack
from endpoint_picker.bench.tokenizer import build_tokenizer


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Everything ``epp bench run`` was asked for."""

    workload: str
    rates: tuple[float, ...]
    duration: float  # seconds of measured arrivals
    seed: int
    report_dir: Path
    targets: tuple[StackSpec, ...] = ()  # --stack
    url: str | None = None  # --url: an OpenAI-compatible endpoint somebody else runs
    server_urls: tuple[str, ...] = ()  # --server: its model servers, for /metrics
    params: dict[str, str] = field(default_factory=dict)
    arrival: str = "poisson"
    burstiness: float = 1.0
    fleet: FleetOptions = field(default_factory=FleetOptions)
    request_timeout: float = 300.0
    progress: bool = True
    warmup: float = 0.0  # seconds of arrivals before the measured ones
    # (kind, seconds after the first arrival, server index): ``disrupt``
    disruptions: tuple[tuple[str, float, int], ...] = ()


async def _measure(
    name: str,
    url: str,
    server_urls: Sequence[str],
    plan: WorkloadPlan,
    options: RunOptions,
    rate: float,
    access_log: Path | None = None,
) -> TargetResult:
    watch = FleetWatch(list(server_urls), warmup=options.warmup)
    await watch.start()
    disrupting = [
        asyncio.create_task(disrupt(kind, server_urls[i], at), name=f"bench-{kind}-{i}")
        for kind, at, i in options.disruptions
        if i < len(server_urls)
    ]
    try:
        records = await client.run_requests(
            url,
            plan.requests,
            label=f"{name} @ {rate:g}/s",
            request_timeout=options.request_timeout,
            progress=options.progress,
        )
    finally:
        for task in disrupting:
            task.cancel()
        await asyncio.gather(*disrupting, return_exceptions=True)
        fleet = await watch.stop()
    router = None
    if access_log is not None:
        await asyncio.sleep(3 * envoytiming.FLUSH_MS / 1e3)  # Envoy's last lines reach the file
        warm = options.warmup
        router = envoytiming.read_timing(access_log, [r.index for r in records if r.due_at >= warm])
    result = TargetResult(
        target=name,
        workload=plan.workload,
        rate=rate,
        duration=options.duration,
        records=tuple(records),
        fleet=fleet,
        warmup=options.warmup,
        router=router,
    )
    problems = stats.validity(result)
    if problems:
        print(f"epp bench: {name} @ {rate:g}/s is INVALID: {'; '.join(problems)}", file=sys.stderr)
    return replace(result, notes=tuple(problems))


_DISRUPT_PATHS = {"reset": "/reset_prefix_cache?reset_running_requests=true",
                  "restart": "/sim/restart"}  # fmt: skip


async def disrupt(kind: str, server_url: str, at: float) -> None:
    """``at`` seconds from now, reset (announced) or restart (silent) one simulated server's
    prefix cache: the approximate index then believes in blocks that are gone."""
    await asyncio.sleep(at)
    url = server_url + _DISRUPT_PATHS[kind]
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session,
            session.post(url) as response,
        ):
            ok = response.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        print(f"epp bench: {kind} of {server_url} failed: {exc!r}", file=sys.stderr)
        return
    print(f"epp bench: {kind} of {server_url} at {at:g} s: {'done' if ok else 'refused'}",
          file=sys.stderr)  # fmt: skip


async def run(options: RunOptions, argv: Sequence[str] = ()) -> list[TargetResult]:
    """Run every target at every rate; write the report; return the results."""
    options.report_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = options.fleet.tokenizer
    if tokenizer is not None:
        # Absolute: the fleet (and the EPP) run in folders of their own.
        path = build_tokenizer(options.report_dir) if tokenizer == "build" else Path(tokenizer)
        if not path.is_file():
            raise BenchError(f"--tokenizer: no such file: {path}")
        options = replace(options, fleet=replace(options.fleet, tokenizer=str(path.resolve())))
    for spec in options.targets:  # before any target starts
        check_fleet(spec, options.fleet)
    work = options.report_dir / "logs"
    work.mkdir(exist_ok=True)
    results: list[TargetResult] = []
    plans: dict[str, Any] = {}
    objectives: dict[str, float] = {}
    criticality: dict[str, str] = {}
    for rate in options.rates:
        plan = workloads.generate(
            options.workload,
            rate=rate,
            duration=options.warmup + options.duration,
            seed=options.seed,
            arrival=options.arrival,
            burstiness=options.burstiness,
            params=options.params,
        )
        plans[f"{rate:g}"] = {"requests": len(plan.requests), "params": plan.params}
        objectives = plan.objectives
        criticality = {name: str(c) for name, c in plan.criticality.items()}
        if options.url is not None:
            results.append(
                await _measure("url", options.url, options.server_urls, plan, options, rate)
            )
            continue
        for spec in options.targets:
            async with running_stack(spec, options.fleet, plan, work) as stack:
                servers, log = stack.server_urls, stack.envoy_access_log
                result = await _measure(spec.name, stack.url, servers, plan, options, rate, log)
                results.append(result)
    meta = {
        "command": shlex.join(["epp", "bench", *argv]),
        "workload": options.workload,
        "params": dict(options.params),
        "plans": plans,
        "seed": options.seed,
        "duration": options.duration,
        "warmup": options.warmup,
        "arrival": options.arrival,
        "burstiness": options.burstiness,
        "objectives": objectives,
        "criticality": criticality,
        "fleet": _fleet_meta(options.fleet),
        "disruptions": [list(d) for d in options.disruptions],
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    report.write_results(options.report_dir, results, meta)
    print(report.tables(results, objectives, criticality))
    report.write_plots(options.report_dir, results)
    return results


def _fleet_meta(fleet: FleetOptions) -> dict[str, Any]:
    return {k: getattr(fleet, k) for k in fleet.__dataclass_fields__}


__all__ = ["FleetObservation", "RunOptions", "run"]
