"""Throughput and latency through Envoy: direct routing vs a no-op ext_proc vs the EPP.

Run: .venv/bin/python benchmarks/bench_extproc.py [--endpoints 16] [--connections 25]
     [--duration 10] [--modes direct,noop,epp]   (needs `wrk`: apt-get install wrk)

Everything on this machine: wrk -> Envoy (the reference config, FULL_DUPLEX_STREAMED, plaintext
to the ext_proc server) -> 16 model-server endpoints on 127.0.0.2.. served by a second Envoy
with direct responses (a JSON completion, and a real-shaped vLLM /metrics page for the EPP's
scrapers). Modes:
- direct: Envoy round-robins over the endpoints itself, no ext_proc (the latency floor);
- noop:   ext_proc to benchmarks/noop_extproc.py, a grpc.aio server doing no work (the
          throughput floor of docs/architecture.md);
- noop-h2: the same no-op on the h2 server (benchmarks/noop_h2.py), the floor of the
          EPP's default gRPC stack;
- epp:    ext_proc to `epp serve` with the default scheduler, scraping every endpoint at 50 ms;
- epp-STACK: the same with `--ext-proc-server STACK` (h2, the default, or grpcio);
- eppN, epp-STACKN: with `--workers N` (give Envoy N threads, `--envoy-concurrency N`, so
          that it opens N connections for the kernel to spread over the workers).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from endpoint_picker import envoy_config
from endpoint_picker.bench.fleetenvoy import (
    BIN,
    PROMPT,
    backend_fleet,
    default_envoy,
    free_port,
    pool_file,
    process,
    wait_ready,
)
from endpoint_picker.bench.procstat import cpu_seconds
from endpoint_picker.settings import EXT_PROC_SERVERS

REPO = Path(__file__).resolve().parents[1]
METRICS_PAGE = REPO / "tests" / "unit" / "metrics" / "fixtures" / "vllm_v1_metrics.txt"  # data


def front_config(
    endpoints: list[str], *, direct: bool, listen_port: int, admin_port: int, epp_port: int
) -> str:
    """The front Envoy: the reference config, or ``direct`` the same without ext_proc, round
    robin over a static cluster of ``endpoints``."""
    text = envoy_config.render(
        "reference",
        listen_address="127.0.0.1",
        listen_port=listen_port,
        admin_port=admin_port,
        epp_port=epp_port,
        epp_tls=False,
    )
    if not direct:
        return text
    config = yaml.safe_load(text)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    hcm["typed_config"]["http_filters"] = [
        f for f in filters if f["name"] not in ("envoy.filters.http.ext_proc",)
    ]
    clusters = config["static_resources"]["clusters"]
    pool = next(c for c in clusters if c["name"] == "inference_pool")
    pool.pop("original_dst_lb_config", None)
    pool.update(
        type="STATIC",
        lb_policy="ROUND_ROBIN",
        load_assignment={
            "cluster_name": "inference_pool",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": e.rsplit(":", 1)[0],
                                        "port_value": int(e.rsplit(":", 1)[1]),
                                    }
                                }
                            }
                        }
                        for e in endpoints
                    ]
                }
            ],
        },
    )
    return yaml.safe_dump(config)


def wait_routing(url: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        request = urllib.request.Request(url, data=PROMPT.encode(), method="POST")
        request.add_header("content-type", "application/json")
        with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"no successful request through {url}")


def run_wrk(url: str, connections: int, duration: int, tmp: Path) -> tuple[float, float, int]:
    script = tmp / "post.lua"
    body = PROMPT.replace("\\", "\\\\").replace('"', '\\"')
    script.write_text(
        f'wrk.method = "POST"\nwrk.body = "{body}"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    assert p50 is not None
    scale = {"us": 1e-3, "ms": 1.0, "s": 1000.0}[p50.group(2)]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rps, float(p50.group(1)) * scale, int(errors.group(1)) if errors else 0


def start_profile(pid: int, mode: str, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    """py-spy samples the ext_proc process (its native gRPC frames too) for the measured run;
    the collapsed stacks go to PROFILE/MODE-N.txt, ready for `summarise_profile.py` or a
    flame-graph tool."""
    spy = shutil.which("py-spy") or str(BIN / "py-spy")
    args.profile.mkdir(parents=True, exist_ok=True)
    number = len(list(args.profile.glob(f"{mode}-*.txt"))) + 1
    out = args.profile / f"{mode}-{number}.txt"
    return subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--duration", str(args.duration), "--rate", "250",
         "--format", "raw", "--nonblocking", "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _epp_mode(mode: str) -> tuple[str, str]:
    """``epp[-STACK][N]`` as (the --ext-proc-server stack or "" for the default, workers)."""
    stacks = "|".join(EXT_PROC_SERVERS)
    match = re.fullmatch(rf"epp(?:-({stacks}))?(\d*)", mode)
    if match is None:
        raise SystemExit(f"unknown mode {mode!r}")
    return match.group(1) or "", match.group(2) or "1"


_NOOP_SCRIPTS = {
    "noop": "noop_extproc.py",
    "noop-h2": "noop_h2.py",
}


def measure(mode: str, args: argparse.Namespace, tmp: Path) -> tuple[float, float, int, float]:
    endpoints = [f"127.0.0.{i + 2}:{args.backend_port}" for i in range(args.endpoints)]
    listen, admin, ext_port = free_port(), free_port(), free_port()
    direct = mode == "direct"
    config = front_config(
        endpoints, direct=direct, listen_port=listen, admin_port=admin, epp_port=ext_port
    )
    (tmp / f"front-{mode}.yaml").write_text(config)
    with contextlib.ExitStack() as stack:
        processor: subprocess.Popen[bytes] | None = None
        if mode in _NOOP_SCRIPTS:
            script = _NOOP_SCRIPTS[mode]
            processor = stack.enter_context(
                process(
                    [
                        sys.executable,
                        str(REPO / "benchmarks" / script),
                        "--port",
                        str(ext_port),
                        "--endpoints",
                        ",".join(endpoints),
                    ],
                    tmp / f"{mode}.log",
                )
            )
        elif mode.startswith("epp"):
            pool_file(endpoints, tmp / "pool.yaml")
            server, workers = _epp_mode(mode)
            processor = stack.enter_context(
                process(
                    [
                        str(BIN / "epp"),
                        "serve",
                        "--pool-file",
                        str(tmp / "pool.yaml"),
                        "--bind-address",
                        "127.0.0.1",
                        "--grpc-port",
                        str(ext_port),
                        "--grpc-health-port",
                        str(free_port()),
                        "--metrics-port",
                        str(free_port()),
                        "--secure-serving",
                        "false",
                        "--workers",
                        workers,
                        "--log-level",
                        "warning",
                        *(["--ext-proc-server", server] if server else []),
                    ],
                    tmp / f"{mode}.log",
                )
            )
        stack.enter_context(
            process(
                [
                    args.envoy,
                    "-c",
                    str(tmp / f"front-{mode}.yaml"),
                    "--concurrency",
                    str(args.envoy_concurrency),
                    "--log-level",
                    "error",
                    "--base-id",
                    str(listen),
                ],
                tmp / f"front-{mode}.log",
            )
        )
        wait_ready(admin)
        url = f"http://127.0.0.1:{listen}/v1/completions"
        wait_routing(url)
        run_wrk(url, args.connections, 2, tmp)  # warm-up
        cpu_before = cpu_seconds(processor.pid, with_children=True) if processor else 0.0
        profiler = start_profile(processor.pid, mode, args) if args.profile and processor else None
        rps, p50, errors = run_wrk(url, args.connections, args.duration, tmp)
        if profiler is not None:
            profiler.wait(timeout=60)
        cpu = cpu_seconds(processor.pid, with_children=True) - cpu_before if processor else 0.0
        # CPU per request of the ext_proc process: comparable even on a busy machine
        return rps, p50, errors, cpu / max(rps * args.duration, 1) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--connections", type=int, default=25)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument(
        "--modes",
        default="direct,noop,epp",
        help="direct, noop, noop-h2, epp, epp-grpcio; eppN: `epp serve --workers N`",
    )
    parser.add_argument(
        "--envoy-concurrency",
        type=int,
        default=1,
        help="the front Envoy's worker threads (each opens its own connection to the EPP, "
        "which is what spreads streams over EPP workers)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternate the modes N times")
    parser.add_argument("--backend-port", type=int, default=18000)
    parser.add_argument("--envoy", default=default_envoy())
    parser.add_argument(
        "--profile",
        type=Path,
        help="folder: sample the ext_proc process with py-spy during each measured run",
    )
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench_extproc: needs wrk (apt-get install wrk)")
    with tempfile.TemporaryDirectory(prefix="bench-extproc-") as tmp_name:
        tmp = Path(tmp_name)
        endpoints = [f"127.0.0.{i + 2}:{args.backend_port}" for i in range(args.endpoints)]
        with backend_fleet(args.envoy, endpoints, tmp, METRICS_PAGE.read_text()):
            # Rounds alternate the modes: this host's speed drifts by tens of percent over
            # minutes, so modes are compared round by round and summarised by the median.
            rounds: dict[str, list[tuple[float, float, int, float]]] = {}
            for number in range(1, args.rounds + 1):
                for mode in args.modes.split(","):
                    rps, p50, errors, cpu_us = measure(mode, args, tmp)
                    rounds.setdefault(mode, []).append((rps, p50, errors, cpu_us))
                    print(
                        f"round {number} {mode:12s} {rps:8.0f} req/s   p50 {p50:6.2f} ms   "
                        f"non-2xx {errors}   ext_proc CPU {cpu_us:5.0f} us/request",
                        flush=True,
                    )
        results = {m: rounds[m] for m in rounds}
        for epp in (m for m in results if m.startswith("epp")):
            for floor in (m for m in ("noop", "noop-h2") if m in results):
                ratios = [e[0] / n[0] for n, e in zip(results[floor], results[epp], strict=True)]
                print(
                    f"{epp} / {floor} throughput per round: "
                    f"{', '.join(f'{r:.0%}' for r in ratios)}; "
                    f"median {statistics.median(ratios):.0%}"
                )
            if "direct" in results:
                extra = [e[1] - d[1] for d, e in zip(results["direct"], results[epp], strict=True)]
                print(
                    f"{epp} p50 over direct, median of rounds: {statistics.median(extra):+.2f} ms"
                )


if __name__ == "__main__":
    main()
