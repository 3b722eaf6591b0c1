"""The ``epp bench`` command line: ``run``, ``soak``, ``workloads`` and ``report``.

Bad input prints one line and exits 2, as every ``epp`` command does.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

EXIT_USAGE = 2
T = TypeVar("T")
_EXTRA_MODULES = ("tqdm", "matplotlib")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of rates: {text!r}") from exc
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive: {text!r}")
    return rates


def _speeds(text: str) -> tuple[float, ...]:
    """``1,1,0.5`` -> factors; the count against --servers is checked by ``FleetOptions``."""
    try:
        speeds = tuple(float(part) for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from exc
    if not all(0 < s < math.inf for s in speeds):
        raise argparse.ArgumentTypeError(f"factors must be positive and finite: {text!r}")
    return speeds


def _disruption(text: str) -> tuple[str, float, int]:
    """``restart@30`` / ``reset@12.5:2`` -> (kind, seconds, server index)."""
    kind, sep, rest = text.partition("@")
    when, _, server = rest.partition(":")
    try:
        seconds, index = float(when), int(server or "0")
    except ValueError:
        seconds, index = -1.0, -1
    if kind not in ("reset", "restart") or not sep or not seconds >= 0 or index < 0:
        raise argparse.ArgumentTypeError(f"use reset|restart@SECONDS[:SERVER]: {text!r}")
    return kind, seconds, index


def _param(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"use KEY=VALUE: {text!r}")
    return key.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="epp bench",
        description="Routing quality on a simulated fleet, side by side with other routers.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    run = sub.add_parser(
        "run",
        help="run a workload against targets and write a report",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument("--workload", required=True, help="see `epp bench workloads`")
    run.add_argument(
        "--param", type=_param, action="append", default=[], metavar="KEY=VALUE",
        help="a workload parameter, repeatable",
    )  # fmt: skip
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--stack",
        metavar="S1,S2,...",
        help="fresh local stacks: rr, lr, epp, epp=PATH.yaml, vllm-router[:POLICY], "
        "sglang-router[:POLICY]",
    )
    where.add_argument("--url", help="an OpenAI-compatible endpoint to measure as it is")
    run.add_argument(
        "--server", action="append", default=[], metavar="URL",
        help="with --url: a model server's base URL to scrape /metrics from, repeatable",
    )  # fmt: skip
    rate = run.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="requests per second")
    rate.add_argument("--rates", type=_rates, metavar="R1,R2,...", help="several rates")
    run.add_argument("--duration", type=float, default=60.0, help="seconds of measured arrivals")
    run.add_argument(
        "--warmup", type=float, default=0.0,
        help="seconds of arrivals sent first and not measured (caches warm, queues settle)",
    )  # fmt: skip
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--arrival", choices=("poisson", "constant", "bursty"), default="poisson")
    run.add_argument("--burstiness", type=float, default=1.0, help="bursty: Gamma shape")
    run.add_argument("--report", type=Path, help="report folder (default bench-results/...)")
    run.add_argument("--request-timeout", type=float, default=300.0, help="seconds")
    run.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (a bar on a terminal, a line every 30 s elsewhere)",
    )
    fleet = run.add_argument_group("the simulated fleet (--stack), passed to `epp sim`")
    fleet.add_argument("--servers", type=int, default=4)
    fleet.add_argument("--profile", help="engine profile (default: the simulator's)")
    fleet.add_argument("--num-gpu-blocks", type=int, help="KV-cache blocks per server")
    fleet.add_argument("--max-num-seqs", type=int)
    fleet.add_argument("--max-loras", type=int)
    fleet.add_argument(
        "--stream-interval", type=int, default=8, help="tokens per SSE chunk after the first"
    )
    fleet.add_argument(
        "--time-scale", type=float, default=1.0,
        help="the fleet's clock speed: below 1 slows it until this machine keeps up",
    )  # fmt: skip
    fleet.add_argument(
        "--server-speeds", type=_speeds, metavar="S1,S2,...",
        help="GPU speed per server, one per --servers (0.5: its steps take twice as long)",
    )  # fmt: skip
    fleet.add_argument(
        "--tokenizer", metavar="build|PATH",
        help="tokenize with a tokenizer.json: `build` trains a small BPE for the bench's prompt "
        "vocabulary into the report folder (default: the simulator's 4 characters per token)",
    )  # fmt: skip
    fleet.add_argument(
        "--kv-events", action="store_true",
        help="every server publishes vLLM's KV-cache events (ZeroMQ, port 5557, replay 5558)",
    )  # fmt: skip
    fleet.add_argument(
        "--kv-events-endpoint", metavar="tcp://HOST:PORT",
        help="with --kv-events: every server connects to this one endpoint, which the EPP "
        "binds (llm-d's centralized mode), instead of each binding its own port 5557",
    )  # fmt: skip
    fleet.add_argument(
        "--kv-events-wire", choices=("current", "legacy"), default="current",
        help="vLLM >= 0.26 (events as maps) or before (positional arrays)",
    )  # fmt: skip
    fleet.add_argument(
        "--disrupt", type=_disruption, action="append", default=[],
        metavar="KIND@SECONDS[:SERVER]",
        help="at SECONDS after the first arrival, `reset` server SERVER's prefix cache (vLLM's "
        "/reset_prefix_cache, announced) or `restart` it (cache lost, in-flight requests fail, "
        "nothing announced); SERVER counts from 0 (default 0); repeatable",
    )  # fmt: skip
    _add_soak_parser(sub)
    sub.add_parser("workloads", help="list the workloads and their parameters")
    rep = sub.add_parser("report", help="re-render a saved run (table and plots)")
    rep.add_argument("dir", type=Path)
    return parser


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"KEY=VALUE expected: {text!r}")
    return key, value


def _add_soak_parser(sub: Any) -> None:
    from endpoint_picker.bench.soak.options import DEFAULT_RAMP

    soak = sub.add_parser(
        "soak",
        help="steady load through Envoy + EPP + the fleet for 30 minutes; nothing may grow",
        description="Steady load through Envoy + EPP + the simulated fleet; the EPP's RSS, "
        "fds, tasks and in-flight gauges are sampled and judged (flat, GROWING, ...). "
        "Exit 0: all flat; 1: a series grows or a gauge did not return to 0; 2: the stack "
        "failed. See the docstring of endpoint_picker.bench.soak.",
    )
    a = soak.add_argument
    a("--rate", type=float, help="requests a second (default: half of what --find-max finds)")
    a("--find-max", action="store_true", help="only ramp up, print the maximum and stop")
    a("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    a("--warmup", type=float, default=300.0, help="seconds not judged (default 300)")
    a("--sample-interval", type=float, default=10.0, help="seconds between samples (10)")
    a("--vanish", type=float, default=0.05, help="share of clients that vanish (0.05)")
    a(
        "--ramp", type=_rates, default=tuple(float(r) for r in DEFAULT_RAMP),
        metavar="R1,R2,...", help="the find-max steps, requests/s",
    )  # fmt: skip
    a("--step", type=float, default=30.0, help="seconds per ramp step (default 30)")
    a("--ttft-p90", type=float, default=0.5, help="the ramp's TTFT p90 bound, seconds")
    a("--seed", type=int, default=1)
    a(
        "--ext-proc-graceful-close", action="store_true",
        help="Envoy half-closes ext_proc streams instead of resetting them (docs/envoy.md)",
    )  # fmt: skip
    a(
        "--worker-max-requests", type=int, default=0, metavar="N",
        help="`epp serve --worker-max-requests N`: the EPP's worker turns over every ~N "
        "streams (RSS, fds and CPU are then the parent's and its workers' together)",
    )  # fmt: skip
    a(
        "--epp-env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
        help="environment of the EPP process only, repeatable (e.g. LD_PRELOAD=... to try "
        "another allocator)",
    )  # fmt: skip
    a("--out", type=Path, help="where the samples, the JSON and the plot go (default: a temp dir)")


def _check_extra() -> None:
    missing = [m for m in _EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"epp bench: error: {', '.join(missing)} missing: install the bench extra "
            "(pip install -e '.[bench]')",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USAGE)


def _list_workloads() -> int:
    from endpoint_picker.bench.workloads import WORKLOADS

    for info in WORKLOADS.values():
        print(f"{info.name}: {info.description}")
        for param in info.params:
            print(f"    {param.name} (default {param.default}): {param.help}")
    return 0


def _run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from endpoint_picker.bench.fleet import FleetOptions
    from endpoint_picker.bench.model import BenchError
    from endpoint_picker.bench.run import RunOptions, run
    from endpoint_picker.bench.stacks import parse_targets

    rates = args.rates or ((args.rate,) if args.rate else None)
    if rates is None:
        raise BenchError("give --rate R or --rates R1,R2,...")
    if args.warmup < 0:
        raise BenchError("--warmup must be 0 or more seconds")
    if args.server and args.url is None:
        raise BenchError("--server goes with --url")
    report_dir = args.report or Path("bench-results") / (
        f"{args.workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    fleet = FleetOptions(
        servers=args.servers,
        profile=args.profile,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_loras=args.max_loras,
        time_scale=args.time_scale,
        stream_interval=args.stream_interval,
        server_speeds=args.server_speeds,
        tokenizer=args.tokenizer,
        kv_events=args.kv_events or args.kv_events_endpoint is not None,
        kv_events_wire=args.kv_events_wire,
        kv_events_endpoint=args.kv_events_endpoint,
    )
    if any(index >= args.servers for _, _, index in args.disrupt):
        raise BenchError(f"--disrupt names a server beyond --servers {args.servers}")
    options = RunOptions(
        workload=args.workload,
        rates=tuple(rates),
        duration=args.duration,
        seed=args.seed,
        report_dir=report_dir,
        targets=tuple(parse_targets(args.stack)) if args.stack else (),
        url=args.url,
        server_urls=tuple(args.server),
        params=dict(args.param),
        arrival=args.arrival,
        burstiness=args.burstiness,
        fleet=fleet,
        request_timeout=args.request_timeout,
        progress=not args.no_progress,
        warmup=args.warmup,
        disruptions=tuple(args.disrupt),
    )
    try:
        asyncio.run(_stoppable(run(options, argv)))
    except asyncio.CancelledError:
        print(
            "epp bench: stopped by a signal; every process it started was stopped", file=sys.stderr
        )
        return 128 + signal.SIGTERM

    print(f"report: {report_dir}", file=sys.stderr)
    return 0


def _soak(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import shlex
    import tempfile

    from endpoint_picker.bench.model import BenchError
    from endpoint_picker.bench.soak.options import SoakOptions
    from endpoint_picker.bench.soak.run import bench_error, run_soak
    from endpoint_picker.bench.stacks import find_envoy

    if args.warmup >= args.duration and not args.find_max:
        raise BenchError("--warmup must be shorter than --duration")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or Path(tempfile.gettempdir()) / f"bench-soak-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    options = SoakOptions(
        out=out,
        command=shlex.join(["epp", "bench", *argv]),
        rate=args.rate,
        find_max=args.find_max,
        duration=args.duration,
        warmup=args.warmup,
        sample_interval=args.sample_interval,
        vanish=args.vanish,
        ramp=tuple(args.ramp),
        step=args.step,
        ttft_p90=args.ttft_p90,
        seed=args.seed,
        ext_proc_graceful_close=args.ext_proc_graceful_close,
        worker_max_requests=args.worker_max_requests,
        epp_env=tuple(args.epp_env),
    )
    find_envoy()
    try:
        return asyncio.run(_stoppable(run_soak(options)))
    except asyncio.CancelledError:
        print(
            "epp bench soak: stopped by a signal; every process it started was stopped",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM
    except BaseException as exc:
        error = bench_error(exc)  # a task group wraps it
        if error is None:
            raise
        raise error from exc


async def _stoppable(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work``; SIGTERM (and SIGINT, also when a background shell ignores it) cancels it,
    so the stacks it started are stopped rather than orphaned."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    _check_extra()
    from endpoint_picker.bench.model import BenchError

    try:
        if args.command == "workloads":
            return _list_workloads()
        if args.command == "report":
            from endpoint_picker.bench.report import render

            render(args.dir)
            return 0
        if args.command == "soak":
            return _soak(args, argv)
        return _run(args, argv)
    except BenchError as exc:
        print(f"epp bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
