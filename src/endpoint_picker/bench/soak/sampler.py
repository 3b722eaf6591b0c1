"""The soak's samples: the EPP process (``/proc``), its ``/metrics``, the fleet's clock, and
the client's window, every ``--sample-interval`` seconds."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import aiohttp

from endpoint_picker.bench.fleetwatch import STEP_LATE, STEP_PLANNED, parse_page
from endpoint_picker.bench.model import BenchError
from endpoint_picker.bench.procstat import is_alive, usage
from endpoint_picker.bench.soak.load import Tally
from endpoint_picker.bench.stacks import RunningStack

EPP_SERIES = {
    "tasks": "inference_extension_event_loop_tasks",
    "running": "inference_model_running_requests",
    "streams": "inference_extension_ext_proc_streams",
    "buffered_kib": "inference_extension_buffered_request_bytes",
    "prefix_index": "inference_extension_prefix_indexer_size",
}


def epp_values(text: str) -> dict[str, float]:
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


def check_alive(stack: RunningStack) -> None:
    """``BenchError`` naming the first process of ``stack`` that has died, with its log."""
    for name, pid in stack.pids.items():
        if not is_alive(pid):
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
            return epp_values(await reply.text())

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
        self.last_cpu = usage(self.pid)["cpu_seconds"]
        self.start = self.last_t = asyncio.get_running_loop().time()
        self.tally.window(1.0)  # a fresh window
        return await self.sample(phase)

    async def sample(self, phase: str) -> dict[str, Any]:
        check_alive(self.stack)
        now = asyncio.get_running_loop().time()
        row: dict[str, Any] = {"t": round(now - self.start, 2), "phase": phase}
        row |= usage(self.pid)
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
