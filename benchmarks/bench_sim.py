"""What the simulator costs, and how much load 16 simulated servers carry in one process.

1. Engine only (no HTTP, manual clock): simulated requests and tokens per CPU-second.
2. /metrics rendering: renders per CPU-second.
3. ``python -m endpoint_picker_sim --servers 16`` in a subprocess, driven by a closed-loop
   streaming client from this process at rising concurrency. For each level: requests/s, tokens/s,
   the simulator's CPU (from /proc), and how late its step loops ran against plan
   (late/plan: sum of sim:step_late_seconds / sum of sim:step_planned_seconds over all servers,
   i.e. mean lateness of token delivery relative to step length; behind/plan: the share of
   simulated GPU time lost because the loop fell too far behind to catch up). A level is "ok"
   when both stay within 5%.

Run:  .venv/bin/python benchmarks/bench_sim.py            (about 1.5 minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import sys
import time
from dataclasses import replace

import aiohttp

from endpoint_picker.bench.procstat import cpu_seconds
from endpoint_picker_sim.clock import ManualClock
from endpoint_picker_sim.config import EngineConfig
from endpoint_picker_sim.engine import Engine
from endpoint_picker_sim.metrics import MetricsRenderer
from endpoint_picker_sim.request import SimRequest
from endpoint_picker_sim.tokenizer import tokenize_text

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_TICK = os.sysconf("SC_CLK_TCK")


def _text(tokens: int, rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghij") for _ in range(tokens * 4))


def bench_engine(requests: int, prompt_tokens: int, max_tokens: int) -> None:
    """Drive one engine by hand as fast as the CPU allows."""
    rng = random.Random(1)
    system = _text(prompt_tokens // 2, rng)
    prompts = [system + _text(prompt_tokens - prompt_tokens // 2, rng) for _ in range(200)]
    clock = ManualClock()
    eng = Engine(replace(EngineConfig(), max_num_seqs=256), clock)
    steps = 0
    start = time.process_time()
    for i in range(requests):
        text = prompts[i % len(prompts)]
        tok = tokenize_text(text, 16, None)
        eng.add(SimRequest(tok.num_tokens, tok.block_hashes, max_tokens, None, text))
    while not eng.idle:
        batch, duration = eng.step()
        clock.t += duration
        eng.commit(batch, clock.t)
        steps += 1
    cpu = time.process_time() - start
    s = eng.stats
    print(
        f"engine only: {requests} requests ({prompt_tokens} prompt + {max_tokens} output tokens, "
        f"256 running): {requests / cpu:,.0f} requests/CPU-s, "
        f"{s.generation_tokens / cpu:,.0f} tokens/CPU-s, {steps / cpu:,.0f} steps/CPU-s; "
        f"simulated {clock.t:.1f} s of GPU time in {cpu:.2f} CPU-s "
        f"({clock.t / cpu:.0f}x real time)"
    )


def bench_render(renders: int) -> None:
    """Cost of one /metrics render with every histogram populated."""
    eng = Engine(EngineConfig(), ManualClock())
    for i in range(50):
        eng.stats.ttft.observe(0.01 * i)
        eng.stats.itl.observe(0.001 * i)
        eng.stats.e2e.observe(0.1 * i)
    eng.stats.set_lora_info("a,b", "c", time.time())
    renderer = MetricsRenderer(MODEL, eng.config)
    start = time.process_time()
    for _ in range(renders):
        text = renderer.render(eng)
    cpu = time.process_time() - start
    print(
        f"/metrics render: {renders / cpu:,.0f} renders/CPU-s "
        f"({cpu / renders * 1e6:.0f} us each, {len(text)} bytes)"
    )


def _machine_busy_seconds() -> float:
    """CPU seconds all processes have used (from /proc/stat), to show other load."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / _TICK


async def _sim_counters(http: aiohttp.ClientSession, urls: list[str]) -> dict[str, float]:
    wanted = ("sim:step_planned_seconds_total", "sim:step_late_seconds_total",
              "sim:step_behind_seconds_total", "sim:steps_total", "sim:step_early_seconds_total",
              "vllm:generation_tokens_total")  # fmt: skip
    totals = dict.fromkeys(wanted, 0.0)
    for url in urls:
        async with http.get(f"{url}/metrics") as resp:
            for line in (await resp.text()).splitlines():
                name = line.split("{", 1)[0]
                if name in totals:
                    totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


async def _client(
    http: aiohttp.ClientSession, url: str, rng: random.Random, args: argparse.Namespace,
    system: str, stop: asyncio.Event, done: list[int],
) -> None:  # fmt: skip
    while not stop.is_set():
        body = {
            "model": MODEL,
            "prompt": system + _text(args.prompt_tokens // 2, rng),
            "max_tokens": args.max_tokens,
            "stream": True,
        }
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            async for _ in resp.content:
                pass
        done[0] += 1


async def bench_servers(args: argparse.Namespace) -> None:
    """Closed-loop streaming load on N servers in one subprocess, at rising concurrency."""
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "endpoint_picker_sim", "--model", MODEL,
        "--servers", str(args.servers), "--address", "127.0.0.2", "--port", str(port),
        "--time-scale", str(args.time_scale), "--stream-interval", str(args.stream_interval),
        "--log-level", "WARNING",
    )  # fmt: skip
    urls = [f"http://127.0.0.{2 + i}:{port}" for i in range(args.servers)]
    print(
        f"\n{args.servers} servers in one process, time-scale {args.time_scale}, "
        f"stream-interval {args.stream_interval}, prompts {args.prompt_tokens} tokens "
        f"(half shared), max_tokens {args.max_tokens}, {args.duration:.0f} s per level"
    )
    print(
        "streams/server  requests/s  tokens/s  sim CPU  steps/s  late/plan  early/plan"
        "  behind/plan  verdict  client CPU  other CPU  req/sim-CPU-s"
    )
    connector = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            for _ in range(100):
                try:
                    await _sim_counters(http, urls)
                    break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
            rng = random.Random(2)
            system = _text(args.prompt_tokens // 2, rng)
            for level in args.levels:
                stop = asyncio.Event()
                done = [0]
                tasks = [
                    asyncio.create_task(_client(http, url, rng, args, system, stop, done))
                    for url in urls
                    for _ in range(level)
                ]
                await asyncio.sleep(args.warmup)
                before, t0, n0 = await _sim_counters(http, urls), time.monotonic(), done[0]
                cpu0, me0 = cpu_seconds(proc.pid), time.process_time()
                all0 = _machine_busy_seconds()
                await asyncio.sleep(args.duration)
                after, t1, n1 = await _sim_counters(http, urls), time.monotonic(), done[0]
                wall = t1 - t0
                cpu1, me1 = cpu_seconds(proc.pid), time.process_time()
                others = (_machine_busy_seconds() - all0 - (cpu1 - cpu0) - (me1 - me0)) / wall
                stop.set()
                await asyncio.gather(*tasks)
                d = {k: after[k] - before[k] for k in after}
                planned = d["sim:step_planned_seconds_total"] or 1e-9
                late = d["sim:step_late_seconds_total"] / planned
                behind = d["sim:step_behind_seconds_total"] / planned
                early = d["sim:step_early_seconds_total"] / planned
                ok = "ok" if late <= 0.05 and behind <= 0.05 else "over"
                print(
                    f"{level:>14}  {(n1 - n0) / wall:>10.0f}  "
                    f"{d['vllm:generation_tokens_total'] / wall:>8.0f}  "
                    f"{(cpu1 - cpu0) / wall:>6.0%}  {d['sim:steps_total'] / wall:>7.0f}  "
                    f"{late:>9.1%}  {early:>10.1%}  {behind:>11.1%}  {ok:>7}  "
                    f"{(me1 - me0) / wall:>10.0%}  {max(others, 0.0):>10.0%}  "
                    f"{(n1 - n0) / max(cpu1 - cpu0, 1e-9):>13.0f}"
                )
    finally:
        proc.terminate()
        await proc.wait()


def main() -> None:
    """Parse flags and run the three benchmarks."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--servers", type=int, default=16)
    p.add_argument("--levels", default="1,4,8,16,32", help="streams per server, per level")
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--stream-interval", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--skip-servers", action="store_true")
    args = p.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    bench_engine(2000, args.prompt_tokens, args.max_tokens)
    bench_render(20000)
    if not args.skip_servers:
        asyncio.run(bench_servers(args))


if __name__ == "__main__":
    main()
