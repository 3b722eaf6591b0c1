"""Throughput and latency through Envoy: direct routing vs a no-op ext_proc vs the EPP.

Run: .venv/bin/python benchmarks/bench_extproc.py [--endpoints 16] [--connections 25]
     [--duration 10] [--modes direct,noop,epp]   (needs `wrk`: apt-get install wrk)

Everything on this machine: wrk -> Envoy (the reference config, FULL_DUPLEX_STREAMED, plaintext
to the ext_proc server) -> 16 model-server endpoints on 127.0.0.2.. served by a second Envoy
with direct responses (a JSON completion, and a real-shaped vLLM /metrics page for the EPP's
scrapers). Modes:
- direct: Envoy round-robins over the endpoints itself, no ext_proc (the latency floor);
- noop:   ext_proc to benchmarks/noop_extproc.py, a grpc.aio server doing no work (the
          throughput floor of DESIGN.md);
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
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from endpoint_picker import envoy_config  # noqa: E402
from endpoint_picker.settings import EXT_PROC_SERVERS  # noqa: E402

BIN = Path(sys.executable).parent
METRICS_PAGE = REPO / "tests" / "unit" / "metrics" / "fixtures" / "vllm_v1_metrics.txt"
COMPLETION = (
    '{"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":0,'
    '"text":" hello there","finish_reason":"length"}],'
    '"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14}}'
)
PROMPT = '{"model": "m", "prompt": "' + "Tell me about routing. " * 20 + '", "max_tokens": 2}'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def filtered_metrics_page() -> str:
    """The fixture as vLLM answers ``/metrics?name[]=...`` for the EPP's default names."""
    from endpoint_picker.metrics.engines import BUILTIN_ENGINES
    from endpoint_picker_sim.metrics import restrict

    return restrict(METRICS_PAGE.read_text(), BUILTIN_ENGINES["vllm"].metric_names())


def backend_config(endpoints: list[str], admin_port: int) -> str:
    filtered = filtered_metrics_page()
    route_config = {
        "name": "backend",
        "max_direct_response_body_size_bytes": 1 << 20,
        "virtual_hosts": [
            {
                "name": "all",
                "domains": ["*"],
                "routes": [
                    *(  # what the EPP asks for by default: vLLM (prometheus_client) filters
                        {
                            "match": {
                                "path": "/metrics",
                                "query_parameters": [{"name": key, "present_match": True}],
                            },
                            "direct_response": {"status": 200, "body": {"inline_string": filtered}},
                        }
                        for key in ("name%5B%5D", "name[]")  # as sent, or decoded
                    ),
                    {
                        "match": {"path": "/metrics"},
                        "direct_response": {
                            "status": 200,
                            "body": {"inline_string": METRICS_PAGE.read_text()},
                        },
                    },
                    {
                        "match": {"prefix": "/"},
                        "direct_response": {"status": 200, "body": {"inline_string": COMPLETION}},
                        "response_headers_to_add": [
                            {"header": {"key": "content-type", "value": "application/json"}}
                        ],
                    },
                ],
            }
        ],
    }
    listeners = []
    for i, endpoint in enumerate(endpoints):
        host, port = endpoint.rsplit(":", 1)
        listeners.append(
            {
                "name": f"backend_{i}",
                "address": {"socket_address": {"address": host, "port_value": int(port)}},
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "name": "envoy.filters.network.http_connection_manager",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters."
                                    "network.http_connection_manager.v3.HttpConnectionManager",
                                    "stat_prefix": f"backend_{i}",
                                    "route_config": route_config,
                                    "http_filters": [
                                        {
                                            "name": "envoy.filters.http.router",
                                            "typed_config": {
                                                "@type": "type.googleapis.com/envoy.extensions."
                                                "filters.http.router.v3.Router"
                                            },
                                        }
                                    ],
                                },
                            }
                        ]
                    }
                ],
            }
        )
    return yaml.safe_dump(
        {
            "admin": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
            },
            "static_resources": {"listeners": listeners},
        }
    )


def direct_config(endpoints: list[str], listen_port: int, admin_port: int) -> str:
    """The front Envoy without ext_proc: round robin over a static cluster."""
    text = envoy_config.render(
        "reference",
        listen_address="127.0.0.1",
        listen_port=listen_port,
        admin_port=admin_port,
        epp_tls=False,
        endpoints=endpoints,
    )
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


def pool_file(endpoints: list[str], path: Path) -> None:
    port = int(endpoints[0].rsplit(":", 1)[1])
    docs: list[dict[str, object]] = [
        {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "bench", "namespace": "default"},
            "spec": {
                "selector": {"matchLabels": {"app": "bench"}},
                "targetPorts": [{"number": port}],
            },
        }
    ]
    for i, endpoint in enumerate(endpoints):
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"pod-{i}",
                    "namespace": "default",
                    "labels": {"app": "bench"},
                },
                "status": {
                    "podIP": endpoint.rsplit(":", 1)[0],
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }
        )
    path.write_text(yaml.safe_dump_all(docs))


@contextlib.contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def backend_fleet(
    envoy: str, endpoints: list[str], tmp: Path, within: float = 30.0
) -> Iterator[None]:
    """The model-server endpoints, answered by one Envoy (``backend_config``), up and ready."""
    admin = free_port()
    (tmp / "backend.yaml").write_text(backend_config(endpoints, admin))
    with process(
        [envoy, "-c", str(tmp / "backend.yaml"), "--concurrency", "1",
         "--log-level", "error", "--base-id", str(admin)],
        tmp / "backend.log",
    ):  # fmt: skip
        wait_ready(admin, within)
        yield


def wait_ready(admin_port: int, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=1) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"Envoy on admin port {admin_port} not ready")


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


def cpu_seconds(pid: int) -> float:
    """User + system CPU so far of a process and its live children (``--workers``), from
    /proc."""
    total = 0.0
    for each in (pid, *_children(pid)):
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


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
    if mode == "direct":
        config = direct_config(endpoints, listen, admin)
    else:
        config = envoy_config.render(
            "reference",
            listen_address="127.0.0.1",
            listen_port=listen,
            admin_port=admin,
            epp_port=ext_port,
            epp_tls=False,
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
        cpu_before = cpu_seconds(processor.pid) if processor else 0.0
        profiler = start_profile(processor.pid, mode, args) if args.profile and processor else None
        rps, p50, errors = run_wrk(url, args.connections, args.duration, tmp)
        if profiler is not None:
            profiler.wait(timeout=60)
        cpu = cpu_seconds(processor.pid) - cpu_before if processor else 0.0
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
    parser.add_argument("--envoy", default=shutil.which("envoy") or str(BIN / "envoy"))
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
        with backend_fleet(args.envoy, endpoints, tmp):
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
