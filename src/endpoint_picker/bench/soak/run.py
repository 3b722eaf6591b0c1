"""One soak: the stack, the ramp that finds the maximum, the soak at a rate, the exit status."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from endpoint_picker.bench.fleet import FleetOptions
from endpoint_picker.bench.model import BenchError, WorkloadPlan
from endpoint_picker.bench.soak.load import ADAPTERS, BASE_MODEL, Client, Mix, Tally, ms
from endpoint_picker.bench.soak.options import (
    AFTER_LOAD,
    LAG_FLOOR,
    LAG_SHARE,
    OK_SHARE,
    STEP_LATE_LIMIT,
    SoakOptions,
)
from endpoint_picker.bench.soak.sampler import Sampler
from endpoint_picker.bench.soak.verdict import failed, report
from endpoint_picker.bench.stacks import RunningStack, StackSpec, running_stack
from endpoint_picker.bench.stats import percentile


def _plan() -> WorkloadPlan:
    """What the fleet serves (the requests are made on the fly, not planned)."""
    return WorkloadPlan("soak", {}, (), BASE_MODEL, adapters=ADAPTERS)


@contextlib.asynccontextmanager
async def _stack(options: SoakOptions) -> AsyncIterator[tuple[RunningStack, aiohttp.ClientSession]]:
    spec = StackSpec(
        "epp", "epp", epp_env=options.epp_env, graceful_close=options.ext_proc_graceful_close,
        worker_max_requests=options.worker_max_requests,
    )  # fmt: skip
    async with (
        running_stack(spec, FleetOptions(), _plan(), options.out / "logs") as stack,
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=10)
        ) as session,
    ):
        yield stack, session


async def _settle(sampler: Sampler, within: float = 20.0) -> None:
    """Until the EPP reports no request running (a step's last requests have ended)."""
    for _ in range(int(within / 0.5)):
        if (await sampler.epp())["running"] == 0:
            return
        await asyncio.sleep(0.5)


def _step_problems(tally: Tally, rate: float, row: dict[str, Any], ttft_bound: float) -> list[str]:
    """Why a ramp step fails (empty: it passes); the module docstring defines each."""
    problems = []
    lag = tally.lag_sum / tally.sent if tally.sent else math.inf
    allowed = max(LAG_SHARE / rate, LAG_FLOOR)
    if lag > allowed:
        problems.append(f"send lag {lag * 1e3:.1f} ms > {allowed * 1e3:.1f} ms")
    if row["sim_late_percent"] > STEP_LATE_LIMIT * 100:
        problems.append(f"fleet clock {row['sim_late_percent']:.1f}% late")
    if tally.ok_share() < OK_SHARE:
        problems.append(f"ok {tally.ok_share():.2%} < {OK_SHARE:.0%}")
    ttft90 = percentile(tally.ttfts, 90)
    if ttft90 is None or ttft90 > ttft_bound:
        problems.append(f"TTFT p90 {ms(ttft90):.0f} ms > {ttft_bound * 1e3:.0f} ms")
    return problems


async def find_max(options: SoakOptions) -> tuple[float, list[dict[str, Any]]]:
    """The ramp on one stack; the highest rate before the first failing step (0: none)."""
    best, steps = 0.0, []
    async with _stack(options) as (
        stack,
        session,
    ):
        client = Client(stack.url, session)
        print(
            f"find-max: {options.step:g} s per step, TTFT p90 bound {options.ttft_p90:g} s",
            flush=True,
        )
        for i, rate in enumerate(options.ramp):
            tally = Tally()
            sampler = Sampler(stack, session, tally)
            await _settle(sampler)
            await sampler.begin()
            await client.run(
                Mix(options.seed + i, options.vanish), rate, options.step, options.seed + i, tally
            )
            row = await sampler.sample("step")
            problems = _step_problems(tally, rate, row, options.ttft_p90)
            lag = tally.lag_sum / max(tally.sent, 1)
            step = {
                "rate": rate, "sent": tally.sent, "ok_share": tally.ok_share(),
                "ttft_p90_ms": ms(percentile(tally.ttfts, 90)), "send_lag_ms": lag * 1e3,
                "send_lag_max_ms": tally.lag_max * 1e3, "fleet_late_percent":
                row["sim_late_percent"], "epp_cpu_percent": row["cpu_percent"],
                "problems": problems,
            }  # fmt: skip
            steps.append(step)
            print(
                f"  {rate:6.1f}/s: {tally.sent} sent, ok {tally.ok_share():.2%}, TTFT p90 "
                f"{step['ttft_p90_ms']:.0f} ms, send lag {lag * 1e3:.2f} ms (max "
                f"{tally.lag_max * 1e3:.0f}), fleet {row['sim_late_percent']:.1f}% late, EPP "
                f"{row['cpu_percent']:.0f}% of a core: {'; '.join(problems) or 'pass'}",
                flush=True,
            )
            if problems:
                break
            best = rate
        else:
            print(f"find-max: every step passed: the maximum is above {best:g}; extend --ramp")
    print(f"find-max: maximum {best:g} requests/s", flush=True)
    return best, steps


async def soak(options: SoakOptions, rate: float) -> tuple[Tally, list[Any], float]:
    """The soak on a fresh stack; returns the tally, the samples and when the load stopped."""
    async with _stack(options) as (
        stack,
        session,
    ):
        tally = Tally()
        sampler = Sampler(stack, session, tally)
        client = Client(stack.url, session)

        def phase(t: float) -> str:  # arrivals stop at ``options.duration``
            if t >= options.duration - 0.5:
                return "drain"
            return "warmup" if t < options.warmup - 0.5 else "load"

        print(
            f"soak: {rate:g} requests/s for {options.duration:g} s (warm-up {options.warmup:g} s), "
            f"a sample every {options.sample_interval:g} s; stack logs in {stack.folder}",
            flush=True,
        )
        await sampler.begin()
        async with asyncio.TaskGroup() as group:  # a dead EPP stops the load at once
            sampling = group.create_task(sampler.every(options.sample_interval, phase))
            await client.run(
                Mix(options.seed, options.vanish), rate, options.duration, options.seed, tally
            )
            await asyncio.sleep(AFTER_LOAD)
            sampling.cancel()
        await sampler.sample("after")
        return tally, sampler.samples, options.duration


def bench_error(exc: BaseException) -> BenchError | None:
    """The BenchError inside ``exc`` (task groups wrap it), if any."""
    if isinstance(exc, BenchError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := bench_error(inner)) is not None:
                return found
    return None


async def run_soak(options: SoakOptions) -> int:
    """Find the maximum, or soak, or both; the exit status (the package docstring)."""
    extra: dict[str, Any] = {}
    rate = options.rate
    if options.find_max or rate is None:
        best, steps = await find_max(options)
        extra |= {"find_max": best, "ramp": steps, "ttft_p90_bound_s": options.ttft_p90}
        (options.out / "find_max.json").write_bytes(orjson.dumps(extra, option=orjson.OPT_INDENT_2))
        if best <= 0:
            print("find-max: no rate of the ramp passed", file=sys.stderr)
            return 1
        if options.find_max:
            return 0
        rate = best / 2
    tally, samples, stopped = await soak(options, rate)
    verdicts = report(options, rate, tally, samples, stopped, extra)
    if failed(verdicts):
        print("soak: FAILED: a series grows or a gauge did not return to 0", file=sys.stderr)
        return 1
    return 0
