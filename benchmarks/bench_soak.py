"""Soak: steady load through Envoy + EPP + the simulated fleet for 30 minutes; nothing may grow.

Run: .venv/bin/python benchmarks/bench_soak.py [--rate R | --find-max] [--duration 1800]
     [--warmup 300] [--out DIR]
     (no --rate: find the maximum first, then soak at half of it on a fresh stack)

The stack is ``epp bench run --stack epp``'s (``endpoint_picker.bench.stacks``): 4 simulated
H100 servers (``epp sim``, one process, 8 tokens per SSE chunk), ``epp serve`` with the default
scheduler as its own process, and Envoy with the shipped ``reference`` config in front.

The load is open loop (Poisson arrivals at ``--rate``, seeded), a request when it is due
whatever happened to earlier ones. Each request is a completion or a chat completion (50/50)
for the base model or one of two LoRA adapters (80/20); its prompt is one of 16 system prompts
(256 tokens: exactly 4 prefix blocks of the EPP's index) and a unique question of 8-40 tokens
(never a full block, so the prefix index's working set is small and fixed: a soak of that LRU
filling up would be another test), with ``max_tokens`` 16-64: the routing path and the
simulator bound the run, not prefills. ``--vanish`` (5%) of the clients vanish: half close the
connection after the first streamed chunk, half send the whole request and reset the connection
0-30 ms later, before the response headers (usually while the EPP or the server holds it). Of
the others, half stream and half do not. Outcomes are counted by kind and status.

**Maximum** (``--find-max``): on one stack, 30 s steps of the ``--ramp`` rates; a step passes
when the whole bench keeps its schedule and serves: the client's mean send lag (time from due
to the request's first byte) is at most 5% of the mean gap between arrivals (2 ms floor, the
event loop's timer resolution), the simulated fleet's step lateness is under 5% of its planned
step time (its clock kept), at least 99% of the requests that did not vanish got a complete 200,
and the TTFT p90 of the streamed ones is under ``--ttft-p90`` (0.5 s). The maximum is the
highest rate before the first failing step: this 2-core machine's, for the client, Envoy, the
EPP and the fleet together, at the ramp's granularity; not the EPP's alone.

**Sampled** every ``--sample-interval`` (10 s), from the start of the load and once more 15 s
after the last request finished: the EPP process's RSS (``/proc/PID/status`` VmRSS), open file
descriptors (``/proc/PID/fd``) and CPU seconds (``/proc/PID/stat``); from its ``/metrics``:
``inference_extension_event_loop_tasks`` (asyncio tasks alive),
``inference_model_running_requests`` (summed over models),
``inference_extension_ext_proc_streams``, ``inference_extension_buffered_request_bytes`` and
``inference_extension_prefix_indexer_size``; and, per interval, at the client: complete
requests per second, TTFT p50/p90 of the streamed requests, e2e p90, mean send lag, and the
fleet's step lateness. Written to ``--out``: ``samples.csv``, ``soak.json`` (samples, outcomes,
verdicts, the command) and ``soak.png`` (a panel per series over time, the warm-up shaded).

**Verdict**, per series, over the samples after the warm-up (``--warmup``, 300 s) until the
arrivals stop: the value at the end of the warm-up, the last value and the maximum; the
least-squares slope as growth per hour ``G`` with its standard error ``SE``; and a budget per
hour ``B = max(5% of the value at the end of the warm-up, floor)``, floors: RSS 2 MiB, fds 4,
tasks 10, running requests 5, streams 5, buffered 64 KiB. ``flat`` when ``G <= B`` (``flat
(noise > budget)`` when ``2 SE > B`` too: a weak statement, run longer); ``GROWING`` when even
``G - 2 SE > B`` (a trend the noise does not explain); otherwise ``inconclusive`` (a run too
short for its noise: the in-flight gauges follow the Poisson load). The running requests,
streams and buffered bytes must also read 0 in the sample after the load, and the event-loop
tasks at most 2 above their count before it (the idle EPP). CPU is shown, not
judged (this host's speed drifts by tens of percent over minutes).

Exit status: 0 when every judged series is flat or inconclusive and everything returned to
idle; 1 when one grows or did not return; 2 when the stack cannot start or a process of it dies;
143 when SIGTERM or SIGINT stopped it (every process it started is stopped in every case).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import math
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from endpoint_picker.bench.fleetwatch import STEP_LATE, STEP_PLANNED, parse_page  # noqa: E402
from endpoint_picker.bench.model import BenchError, WorkloadPlan  # noqa: E402
from endpoint_picker.bench.prompts import TextSource  # noqa: E402
from endpoint_picker.bench.stacks import (  # noqa: E402
    FleetOptions,
    RunningStack,
    StackSpec,
    find_envoy,
    running_stack,
)

BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ADAPTERS = ("soak-lora-0", "soak-lora-1")
GROUPS = 16
SYSTEM_TOKENS = 256  # 4 blocks of the EPP's prefix index (64 tokens, 256 characters, each)
REQUEST_TIMEOUT = 60.0
AFTER_LOAD = 15.0  # seconds between the last request's end and the final sample
LAG_SHARE, LAG_FLOOR = 0.05, 0.002  # the schedule: mean send lag vs the mean gap
STEP_LATE_LIMIT = 0.05  # the fleet's clock: late / planned step time
OK_SHARE = 0.99
DEFAULT_RAMP = "20,40,60,80,100,125,150,175,200,250,300,350,400,450,500,600,700,800"
_TICK = os.sysconf("SC_CLK_TCK")
KINDS = ("stream", "plain", "vanish-after-first-chunk", "vanish-before-headers")


# -- the requests ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    kind: str
    path: str
    body: bytes


class Mix:
    """Seeded request bodies: completion or chat, base model or adapter, stream or not."""

    def __init__(self, seed: int, vanish: float) -> None:
        self.rng = random.Random(f"{seed}:soak")
        text = TextSource(random.Random(f"{seed}:text"))
        self.systems = [text.text(f"System prompt {g}: ", SYSTEM_TOKENS) for g in range(GROUPS)]
        self.text = text
        self.vanish = vanish
        self.count = 0

    def next(self) -> Job:
        rng = self.rng
        self.count += 1
        if rng.random() < self.vanish:
            kind = KINDS[2] if rng.random() < 0.5 else KINDS[3]
        else:
            kind = KINDS[0] if rng.random() < 0.5 else KINDS[1]
        model = BASE_MODEL if rng.random() < 0.8 else rng.choice(ADAPTERS)
        system = rng.choice(self.systems)
        question = self.text.text(f"Question {self.count}: ", rng.randint(8, 40))
        body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(16, 64)}
        if kind != KINDS[1]:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        if rng.random() < 0.5:
            path = "/v1/completions"
            body["prompt"] = f"{system} {question}"
        else:
            path = "/v1/chat/completions"
            body["messages"] = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
        return Job(kind, path, orjson.dumps(body))


# -- the client -----------------------------------------------------------------------------


@dataclass
class Tally:
    """What the client saw: totals, and the figures of the current sampling window."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    done: int = 0  # complete 200s
    lag_sum: float = 0.0
    lag_max: float = 0.0
    ttfts: list[float] = field(default_factory=list)  # streamed, whole run (find-max steps)
    # the window since the last sample
    w_done: int = 0
    w_errors: int = 0
    w_sent: int = 0
    w_lag: float = 0.0
    w_ttft: list[float] = field(default_factory=list)
    w_e2e: list[float] = field(default_factory=list)

    def outcome(self, kind: str, status: str, error: str = "") -> None:
        self.outcomes[kind, status] += 1
        if status == "200":
            self.done += 1
            self.w_done += 1
        if status not in ("200", "vanished"):
            self.w_errors += 1
            self.errors[error or f"HTTP {status}"] += 1

    def ok_share(self) -> float:
        """Complete 200s among the requests that were not meant to vanish."""
        kept = [(s, n) for (k, s), n in self.outcomes.items() if not k.startswith("vanish")]
        total = sum(n for _, n in kept)
        return sum(n for s, n in kept if s == "200") / total if total else 0.0

    def window(self, seconds: float) -> dict[str, float]:
        """The window's figures; starts the next window."""
        out = {
            "completed_per_s": self.w_done / seconds,
            "errors": float(self.w_errors),
            "ttft_p50_ms": _quantile(self.w_ttft, 0.5) * 1e3,
            "ttft_p90_ms": _quantile(self.w_ttft, 0.9) * 1e3,
            "e2e_p90_ms": _quantile(self.w_e2e, 0.9) * 1e3,
            "send_lag_ms": self.w_lag / self.w_sent * 1e3 if self.w_sent else math.nan,
        }
        self.w_done = self.w_errors = self.w_sent = 0
        self.w_lag = 0.0
        self.w_ttft, self.w_e2e = [], []
        return out


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Client:
    """Sends jobs to Envoy on an open-loop schedule; counts into a ``Tally``."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url.rstrip("/")
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
        self.rng = random.Random("vanish-delays")

    async def run(self, mix: Mix, rate: float, duration: float, seed: int, tally: Tally) -> None:
        """Poisson arrivals at ``rate`` for ``duration`` seconds; returns when all have ended."""
        loop = asyncio.get_running_loop()
        gaps = random.Random(f"{seed}:arrivals:{rate}")
        start = loop.time()
        at = gaps.expovariate(rate)
        async with asyncio.TaskGroup() as group:
            while at < duration:
                delay = start + at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                group.create_task(self.one(mix.next(), start + at, tally))
                at += gaps.expovariate(rate)

    async def one(self, job: Job, due: float, tally: Tally) -> None:
        lag = max(0.0, asyncio.get_running_loop().time() - due)
        tally.sent += 1
        tally.w_sent += 1
        tally.lag_sum += lag
        tally.w_lag += lag
        tally.lag_max = max(tally.lag_max, lag)
        if job.kind == "vanish-before-headers":
            await self.vanish_early(job, tally)
        else:
            await self.request(job, tally)

    async def request(self, job: Job, tally: Tally) -> None:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        streamed = job.kind != "plain"
        vanish = job.kind == "vanish-after-first-chunk"
        status = "0"
        try:
            async with self.session.post(
                self.url + job.path,
                data=job.body,
                headers={"Content-Type": "application/json"},
                timeout=self.timeout,
            ) as response:
                status = str(response.status)
                if response.status != 200:
                    await response.read()
                    tally.outcome(job.kind, status)
                    return
                if not streamed:
                    answer = orjson.loads(await response.read())
                    if not answer.get("choices"):
                        tally.outcome(job.kind, "200-no-choices")
                        return
                    tally.w_e2e.append(loop.time() - sent)
                    tally.outcome(job.kind, "200")
                    return
                tail, first = b"", True
                async for chunk in response.content.iter_any():
                    if first:
                        first = False
                        if vanish:  # the client is gone: the connection closes unread
                            response.close()
                            tally.outcome(job.kind, "vanished")
                            return
                        ttft = loop.time() - sent
                        tally.ttfts.append(ttft)
                        tally.w_ttft.append(ttft)
                    tail = (tail + chunk)[-64:]
                if b"[DONE]" not in tail:
                    tally.outcome(job.kind, "200-incomplete")
                    return
                tally.w_e2e.append(loop.time() - sent)
                tally.outcome(job.kind, "200")
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
            tally.outcome(job.kind, status if status != "200" else "200-broken", _error(exc))

    async def vanish_early(self, job: Job, tally: Tally) -> None:
        """Send the whole request, then reset the connection before the response headers."""
        head = (
            f"POST {job.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(job.body)}\r\n\r\n"
        ).encode()
        try:
            _, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as exc:
            tally.outcome(job.kind, "0", _error(exc))
            return
        try:
            writer.write(head + job.body)
            await writer.drain()
            await asyncio.sleep(self.rng.uniform(0.0, 0.03))
        finally:
            writer.transport.abort()
        tally.outcome(job.kind, "vanished")


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]


# -- sampling the EPP -----------------------------------------------------------------------

EPP_SERIES = {
    "tasks": "inference_extension_event_loop_tasks",
    "running": "inference_model_running_requests",
    "streams": "inference_extension_ext_proc_streams",
    "buffered_kib": "inference_extension_buffered_request_bytes",
    "prefix_index": "inference_extension_prefix_indexer_size",
}


def _epp_values(text: str) -> dict[str, float]:
    """The EPP_SERIES from a metrics page, each summed over its label sets."""
    wanted = {name: key for key, name in EPP_SERIES.items()}
    out = dict.fromkeys(EPP_SERIES, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[wanted[name]] += float(line.rsplit(" ", 1)[1])
    out["buffered_kib"] /= 1024
    return out


def _proc(pid: int) -> dict[str, float]:
    """RSS (MiB), open fds and CPU seconds of ``pid`` and its worker processes, if any (the
    CPU of workers already reaped is in the parent's children times); ``BenchError`` if the
    EPP is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError as exc:
        raise BenchError(f"the EPP (pid {pid}) is gone: {exc}") from exc
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith("Z"):
        raise BenchError(f"the EPP (pid {pid}) exited")
    rss_kib, fds = float(fields["VmRSS"].split()[0]), 0
    ticks = sum(int(v) for v in stat[11:15])  # utime, stime, cutime, cstime
    for each in (pid, *_children(pid)):
        with contextlib.suppress(OSError):  # a worker that has just exited
            fds += len(os.listdir(f"/proc/{each}/fd"))
            if each != pid:
                child = Path(f"/proc/{each}/status").read_text()
                rss_kib += float(child.split("VmRSS:", 1)[1].split()[0])
                child_stat = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(child_stat[11]) + int(child_stat[12])
    return {"rss_mib": rss_kib / 1024, "fds": float(fds), "cpu_seconds": ticks / _TICK}


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (``epp serve --workers``'s workers)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return children


def _check_alive(stack: RunningStack) -> None:
    for name, pid in stack.pids.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("Z", "X", "gone"):
            raise BenchError(
                f"{name} (pid {pid}) died during the run; log: {stack.log_paths[name]}"
            )


class Sampler:
    """Samples the EPP process, its /metrics, the fleet's clock and the client's window."""

    def __init__(self, stack: RunningStack, session: aiohttp.ClientSession, tally: Tally) -> None:
        if stack.epp_metrics_url is None:
            raise BenchError("the stack has no EPP to sample")
        self.metrics_url = f"{stack.epp_metrics_url}/metrics"
        self.stack = stack
        self.session = session
        self.tally = tally
        self.pid = stack.pids["epp"]
        self.samples: list[dict[str, Any]] = []
        self.start = 0.0
        self.last_t = 0.0
        self.last_cpu = 0.0
        self.last_steps = (0.0, 0.0)

    async def epp(self) -> dict[str, float]:
        async with self.session.get(self.metrics_url) as reply:
            return _epp_values(await reply.text())

    async def fleet_steps(self) -> tuple[float, float]:
        """The fleet's (planned, late) step seconds, summed over servers."""
        planned = late = 0.0
        for server in self.stack.server_urls:
            async with self.session.get(f"{server}/metrics") as reply:
                page = parse_page(await reply.text())
            planned += sum(page.get(STEP_PLANNED, ()))
            late += sum(page.get(STEP_LATE, ()))
        return planned, late

    async def begin(self, phase: str = "start") -> dict[str, Any]:
        """Baselines, and the first sample (``t`` 0: the client's window figures are NaN)."""
        self.last_steps = await self.fleet_steps()
        self.last_cpu = _proc(self.pid)["cpu_seconds"]
        self.start = self.last_t = asyncio.get_running_loop().time()
        self.tally.window(1.0)  # a fresh window
        return await self.sample(phase)

    async def sample(self, phase: str) -> dict[str, Any]:
        _check_alive(self.stack)
        now = asyncio.get_running_loop().time()
        row: dict[str, Any] = {"t": round(now - self.start, 2), "phase": phase}
        row |= _proc(self.pid)
        row |= await self.epp()
        planned, late = await self.fleet_steps()
        span = now - self.last_t
        window = self.tally.window(max(span, 1e-9))
        if span < 0.5:  # the first sample: no interval to speak of
            window = dict.fromkeys(window, math.nan)
            row["cpu_percent"] = row["sim_late_percent"] = math.nan
        else:
            row["cpu_percent"] = (row["cpu_seconds"] - self.last_cpu) / span * 100
            d_planned = planned - self.last_steps[0]
            d_late = late - self.last_steps[1]
            row["sim_late_percent"] = d_late / d_planned * 100 if d_planned > 0 else 0.0
        row |= window
        row["completed"] = self.tally.done
        self.last_t, self.last_cpu, self.last_steps = now, row["cpu_seconds"], (planned, late)
        self.samples.append(row)
        return row

    async def every(self, interval: float, phase: Callable[[float], str]) -> None:
        """A sample every ``interval`` seconds from ``start``, printed; ``phase(t)`` labels it."""
        loop = asyncio.get_running_loop()
        n = 1
        while True:
            await asyncio.sleep(max(0.0, self.start + n * interval - loop.time()))
            n += 1
            row = await self.sample(phase(loop.time() - self.start))
            print(
                f"  {row['t']:7.1f}s {row['phase']:6} rss {row['rss_mib']:6.1f} MiB  "
                f"fds {row['fds']:3.0f}  tasks {row['tasks']:4.0f}  running "
                f"{row['running']:3.0f}  streams {row['streams']:3.0f}  cpu "
                f"{row['cpu_percent']:5.1f}%  {row['completed_per_s']:6.1f} req/s  "
                f"TTFT p90 {row['ttft_p90_ms']:6.1f} ms  errors {row['errors']:.0f}",
                flush=True,
            )


# -- one stack ------------------------------------------------------------------------------


def _plan() -> WorkloadPlan:
    """What the fleet serves (the requests are made on the fly, not planned)."""
    return WorkloadPlan("soak", {}, (), BASE_MODEL, adapters=ADAPTERS)


@contextlib.asynccontextmanager
async def _stack(out: Path, args: argparse.Namespace) -> Any:
    spec = StackSpec(
        "epp", "epp", epp_env=tuple(args.epp_env), graceful_close=args.ext_proc_graceful_close,
        worker_max_requests=args.worker_max_requests,
    )  # fmt: skip
    async with (
        running_stack(spec, FleetOptions(), _plan(), out / "logs") as stack,
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


# -- the maximum ----------------------------------------------------------------------------


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
    ttft90 = _quantile(tally.ttfts, 0.9)
    if not ttft90 <= ttft_bound:
        problems.append(f"TTFT p90 {ttft90 * 1e3:.0f} ms > {ttft_bound * 1e3:.0f} ms")
    return problems


async def find_max(args: argparse.Namespace, out: Path) -> tuple[float, list[dict[str, Any]]]:
    """The ramp on one stack; the highest rate before the first failing step (0: none)."""
    best, steps = 0.0, []
    async with _stack(out, args) as (
        stack,
        session,
    ):
        client = Client(stack.url, session)
        print(f"find-max: {args.step:g} s per step, TTFT p90 bound {args.ttft_p90:g} s", flush=True)
        for i, rate in enumerate(args.ramp):
            tally = Tally()
            sampler = Sampler(stack, session, tally)
            await _settle(sampler)
            await sampler.begin()
            await client.run(Mix(args.seed + i, args.vanish), rate, args.step, args.seed + i, tally)
            row = await sampler.sample("step")
            problems = _step_problems(tally, rate, row, args.ttft_p90)
            lag = tally.lag_sum / max(tally.sent, 1)
            step = {
                "rate": rate, "sent": tally.sent, "ok_share": tally.ok_share(),
                "ttft_p90_ms": _quantile(tally.ttfts, 0.9) * 1e3, "send_lag_ms": lag * 1e3,
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


# -- the soak -------------------------------------------------------------------------------


async def soak(args: argparse.Namespace, out: Path, rate: float) -> tuple[Tally, list[Any], float]:
    """The soak on a fresh stack; returns the tally, the samples and when the load stopped."""
    async with _stack(out, args) as (
        stack,
        session,
    ):
        tally = Tally()
        sampler = Sampler(stack, session, tally)
        client = Client(stack.url, session)

        def phase(t: float) -> str:  # arrivals stop at ``args.duration``
            if t >= args.duration - 0.5:
                return "drain"
            return "warmup" if t < args.warmup - 0.5 else "load"

        print(
            f"soak: {rate:g} requests/s for {args.duration:g} s (warm-up {args.warmup:g} s), "
            f"a sample every {args.sample_interval:g} s; stack logs in {stack.folder}",
            flush=True,
        )
        await sampler.begin()
        async with asyncio.TaskGroup() as group:  # a dead EPP stops the load at once
            sampling = group.create_task(sampler.every(args.sample_interval, phase))
            await client.run(Mix(args.seed, args.vanish), rate, args.duration, args.seed, tally)
            await asyncio.sleep(AFTER_LOAD)
            sampling.cancel()
        await sampler.sample("after")
        return tally, sampler.samples, args.duration


@dataclass(frozen=True, slots=True)
class Rule:
    key: str
    label: str
    floor: float  # the budget's floor, per hour
    back_to_zero: bool = False


RULES = (
    Rule("rss_mib", "RSS MiB", 2.0),
    Rule("fds", "open fds", 4.0),
    Rule("tasks", "event-loop tasks", 10.0),
    Rule("running", "running requests", 5.0, back_to_zero=True),
    Rule("streams", "ext_proc streams", 5.0, back_to_zero=True),
    Rule("buffered_kib", "buffered KiB", 64.0, back_to_zero=True),
)
BUDGET_SHARE = 0.05  # of the value at the end of the warm-up, per hour
IDLE_TASKS_SLACK = 2  # event-loop tasks after the load, over the idle count before it


def judge(samples: Sequence[dict[str, Any]], warmup: float) -> list[dict[str, Any]]:
    """Each rule's verdict over the samples after the warm-up (the module docstring)."""
    window = [s for s in samples if s["phase"] == "load" and s["t"] >= warmup - 0.5]
    after = samples[-1]
    out = []
    for rule in RULES:
        xs = [s["t"] for s in window]
        ys = [float(s[rule.key]) for s in window]
        verdict: dict[str, Any] = {"series": rule.key, "label": rule.label}
        if len(ys) < 3:
            verdict["verdict"] = "too few samples after the warm-up"
            out.append(verdict)
            continue
        fit = statistics.linear_regression(xs, ys)
        residuals = [y - (fit.intercept + fit.slope * x) for x, y in zip(xs, ys, strict=True)]
        mean_x = statistics.fmean(xs)
        spread = sum((x - mean_x) ** 2 for x in xs)
        se = math.sqrt(sum(r * r for r in residuals) / (len(ys) - 2) / spread)
        growth, noise = fit.slope * 3600, 2 * se * 3600
        budget = max(BUDGET_SHARE * ys[0], rule.floor)
        if growth <= budget:
            word = "flat" if noise <= budget else "flat (noise > budget)"
        elif growth - noise > budget:
            word = "GROWING"
        else:
            word = "inconclusive"
        verdict |= {
            "warmup_end": ys[0], "last": ys[-1], "max": max(ys), "growth_per_hour": growth,
            "two_se_per_hour": noise, "budget_per_hour": budget, "verdict": word,
            "after_load": float(after[rule.key]),
        }  # fmt: skip
        if rule.back_to_zero and after[rule.key] != 0:
            verdict["verdict"] = f"{word}; NOT BACK TO 0"
        if rule.key == "tasks":  # idle again: the load's tasks are all gone
            idle = float(samples[0]["tasks"])
            verdict["idle_before"] = idle
            if after["tasks"] > idle + IDLE_TASKS_SLACK:
                verdict["verdict"] = f"{word}; NOT BACK TO IDLE ({idle:.0f} before the load)"
        out.append(verdict)
    return out


def _failed(verdicts: Sequence[dict[str, Any]]) -> bool:
    return any("GROWING" in v["verdict"] or "NOT BACK" in v["verdict"] for v in verdicts)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds % 60 == 0 else f"{seconds:g} s"


# -- the report -----------------------------------------------------------------------------

PANELS = (
    ("rss_mib", "EPP RSS (MiB)"),
    ("fds", "EPP open file descriptors"),
    ("tasks", "EPP event-loop tasks"),
    ("cpu_percent", "EPP CPU (% of a core)"),
    ("running", "running requests (EPP gauge, summed)"),
    ("streams", "open ext_proc streams (EPP)"),
    ("buffered_kib", "buffered request bodies (KiB, EPP)"),
    ("prefix_index", "prefix index entries (EPP)"),
    ("completed_per_s", "completed requests/s (client)"),
    ("ttft_p90_ms", "TTFT p90, streamed (ms, client)"),
)


def plot(
    samples: Sequence[dict[str, Any]], warmup: float, stopped: float, path: Path, title: str
) -> None:
    """A panel per series over time; the warm-up shaded, the end of the load dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 14))
    axes = figure.subplots(len(PANELS) // 2, 2, sharex=True)
    minutes = [s["t"] / 60 for s in samples]
    for ax, (key, name) in zip(axes.flat, PANELS, strict=True):
        ax.plot(minutes, [s[key] for s in samples], marker=".", markersize=4, linewidth=1)
        ax.axvspan(0, warmup / 60, color="0.88", label="warm-up")
        ax.axvline(stopped / 60, color="0.4", linestyle="--", linewidth=1, label="load stops")
        ax.set_title(name, fontsize=10)
        if key != "rss_mib":  # RSS: zoomed in, so that a drift of a few MiB shows
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("minutes since the load started")
    axes[0][0].legend(loc="lower right", fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=90)


def _fmt(value: float) -> str:
    return f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"


def report(
    args: argparse.Namespace,
    out: Path,
    rate: float,
    tally: Tally,
    samples: list[dict[str, Any]],
    stopped: float,
    extra: dict[str, Any],
) -> list[dict[str, Any]]:
    """Print the figures and the verdicts; write the CSV, the JSON and the plot."""
    verdicts = judge(samples, args.warmup)
    window = [s for s in samples if s["phase"] == "load" and s["t"] >= args.warmup - 0.5]
    print(f"\nsoak: {rate:g} requests/s for {args.duration:g} s, warm-up {args.warmup:g} s")
    print(f"  sent {tally.sent:,}; complete 200s {tally.done:,}; ok share {tally.ok_share():.3%}")
    for (kind, status), n in sorted(tally.outcomes.items()):
        print(f"    {kind:26} {status:16} {n:8,}")
    print(f"  errors: {dict(tally.errors.most_common(8)) or 'none'}")
    lag = tally.lag_sum / max(tally.sent, 1)
    allowed = max(LAG_SHARE / rate, LAG_FLOOR)
    kept = "kept" if lag <= allowed else "NOT KEPT: the EPP saw less than the asked rate"
    print(f"  schedule: mean send lag {lag * 1e3:.2f} ms (max {tally.lag_max * 1e3:.0f} ms, "
          f"allowed {allowed * 1e3:.1f} ms): {kept}")  # fmt: skip
    if window:
        late = statistics.fmean(s["sim_late_percent"] for s in window)
        ttft = statistics.median(s["ttft_p90_ms"] for s in window)
        cpu = statistics.fmean(s["cpu_percent"] for s in window)
        first, last = window[0], window[-1]
        cpu_ms = (
            (last["cpu_seconds"] - first["cpu_seconds"])
            / max(last["completed"] - first["completed"], 1)
            * 1e3
        )
        print(f"  after the warm-up: fleet {late:.1f}% late; TTFT p90 median of windows "
              f"{ttft:.0f} ms; EPP {cpu:.0f}% of a core, {cpu_ms:.2f} ms CPU per complete "
              f"request")  # fmt: skip
    start, after = samples[0], samples[-1]
    print(f"  idle before the load -> {AFTER_LOAD:g} s after it: tasks {start['tasks']:.0f} -> "
          f"{after['tasks']:.0f}, fds {start['fds']:.0f} -> {after['fds']:.0f}, RSS "
          f"{start['rss_mib']:.1f} -> {after['rss_mib']:.1f} MiB")  # fmt: skip
    print(f"\n  {'series':18} {'warm-up end':>11} {'last':>9} {'max':>9} {'growth/h':>10} "
          f"{'+-2SE/h':>9} {'budget/h':>9} {'after':>7}  verdict")  # fmt: skip
    for v in verdicts:
        if "growth_per_hour" not in v:
            print(f"  {v['label']:18} {v['verdict']}")
            continue
        print(f"  {v['label']:18} {_fmt(v['warmup_end']):>11} {_fmt(v['last']):>9} "
              f"{_fmt(v['max']):>9} {_fmt(v['growth_per_hour']):>10} "
              f"{_fmt(v['two_se_per_hour']):>9} {_fmt(v['budget_per_hour']):>9} "
              f"{_fmt(v['after_load']):>7}  {v['verdict']}")  # fmt: skip
    keys = list(samples[0])
    with (out / "samples.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(samples)
    document = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rate": rate, "duration": args.duration, "warmup": args.warmup,
        "sample_interval": args.sample_interval, "vanish": args.vanish, "seed": args.seed,
        "load_stopped_at": stopped, "sent": tally.sent, "complete": tally.done,
        "outcomes": {f"{k} {s}": n for (k, s), n in sorted(tally.outcomes.items())},
        "errors": dict(tally.errors), "send_lag_mean_ms": lag * 1e3,
        "send_lag_max_ms": tally.lag_max * 1e3, "verdicts": verdicts, "samples": samples,
        **extra,
    }  # fmt: skip
    (out / "soak.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    title = (f"EPP soak: {rate:g} requests/s for {_minutes(args.duration)} "
             f"(warm-up {_minutes(args.warmup)} shaded), {time.strftime('%Y-%m-%d')}")  # fmt: skip
    plot(samples, args.warmup, stopped, out / "soak.png", title)
    print(f"\nwrote {out / 'samples.csv'}, {out / 'soak.json'}, {out / 'soak.png'}")
    return verdicts


# -- main -----------------------------------------------------------------------------------


def _bench_error(exc: BaseException) -> BenchError | None:
    """The BenchError inside ``exc`` (task groups wrap it), if any."""
    if isinstance(exc, BenchError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _bench_error(inner)) is not None:
                return found
    return None


async def _main(args: argparse.Namespace, out: Path) -> int:
    extra: dict[str, Any] = {}
    rate = args.rate
    if args.find_max or rate is None:
        best, steps = await find_max(args, out)
        extra |= {"find_max": best, "ramp": steps, "ttft_p90_bound_s": args.ttft_p90}
        (out / "find_max.json").write_bytes(orjson.dumps(extra, option=orjson.OPT_INDENT_2))
        if best <= 0:
            print("find-max: no rate of the ramp passed", file=sys.stderr)
            return 1
        if args.find_max:
            return 0
        rate = best / 2
    tally, samples, stopped = await soak(args, out, rate)
    verdicts = report(args, out, rate, tally, samples, stopped, extra)
    if _failed(verdicts):
        print("soak: FAILED: a series grows or a gauge did not return to 0", file=sys.stderr)
        return 1
    return 0


async def _stoppable(work: Coroutine[Any, Any, int]) -> int:
    """Run ``work``; SIGTERM and SIGINT cancel it, so the stack it started is stopped rather
    than orphaned (as ``epp bench`` does)."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"KEY=VALUE expected: {text!r}")
    return key, value


def _rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"positive rates, comma-separated: {text!r}")
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = parser.add_argument
    a("--rate", type=float, help="requests a second (default: half of what --find-max finds)")
    a("--find-max", action="store_true", help="only ramp up, print the maximum and stop")
    a("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    a("--warmup", type=float, default=300.0, help="seconds not judged (default 300)")
    a("--sample-interval", type=float, default=10.0, help="seconds between samples")
    a("--vanish", type=float, default=0.05, help="share of clients that vanish (0.05)")
    a("--ramp", type=_rates, default=_rates(DEFAULT_RAMP), help="the find-max steps, requests/s")
    a("--step", type=float, default=30.0, help="seconds per ramp step (default 30)")
    a("--ttft-p90", type=float, default=0.5, help="the ramp's TTFT p90 bound, seconds")
    a("--seed", type=int, default=1)
    a(
        "--ext-proc-graceful-close",
        action="store_true",
        help="Envoy half-closes ext_proc streams instead of resetting them (docs/envoy.md)",
    )
    a(
        "--worker-max-requests",
        type=int,
        default=0,
        metavar="N",
        help="`epp serve --worker-max-requests N`: the EPP's worker turns over every ~N "
        "streams (RSS, fds and CPU are then the parent's and its workers' together)",
    )
    a(
        "--epp-env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the EPP process only, repeatable (e.g. LD_PRELOAD=... to try "
        "another allocator)",
    )
    a("--out", type=Path, help="where the samples, the JSON and the plot go (default: a temp dir)")
    args = parser.parse_args()
    if args.warmup >= args.duration and not args.find_max:
        parser.error("--warmup must be shorter than --duration")
    out = args.out or Path(tempfile.gettempdir()) / f"bench-soak-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        find_envoy()
        return asyncio.run(_stoppable(_main(args, out)))
    except asyncio.CancelledError:
        print(
            "bench_soak: stopped by a signal; every process it started was stopped", file=sys.stderr
        )
        return 128 + signal.SIGTERM
    except BaseException as exc:
        error = _bench_error(exc)
        if error is None:
            raise
        print(f"bench_soak: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
