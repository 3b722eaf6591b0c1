"""A fresh local stack per target: the simulated fleet (``fleet``), and what routes to it.

``running_stack(spec, fleet, plan, work_dir)`` starts one target's child processes, waits until
each answers, yields a ``RunningStack`` and stops them all on exit (SIGTERM, then SIGKILL after
a grace), front to back:

- ``rr`` / ``lr``: ``epp sim`` and Envoy round robin / least request over a STATIC cluster
  (``envoy_direct``).
- ``epp`` / ``epp=PATH.yaml``: ``epp sim``, ``epp serve`` with a pool file generated for the fleet
  (and ``--config-file PATH``), and Envoy with the shipped ``reference`` configuration.
- ``vllm-router[:POLICY]`` / ``sglang-router[:POLICY]``: ``epp sim`` and the router (``peers``).

Caches are cold because every process is new. Everything listens on loopback (the fleet on
127.0.0.2 and up, the rest on 127.0.0.1) on free ports; each stack writes its configs and one
log per child into a fresh folder under ``work_dir``. A stack that is not up within
``startup_timeout`` raises ``BenchError`` with the failing child's log tail.

The ``--stack`` entries are parsed into ``StackSpec``s by ``targets`` (``parse_targets``,
``find_envoy`` and ``StackSpec`` are importable from here too).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from endpoint_picker import envoy_config
from endpoint_picker.bench import envoytiming, peers
from endpoint_picker.bench.envoy_direct import render_direct
from endpoint_picker.bench.fleet import KV_EVENTS_PORT, FleetOptions
from endpoint_picker.bench.model import BenchError, WorkloadPlan
from endpoint_picker.bench.pods import pool_file_text
from endpoint_picker.bench.processes import (
    Child,
    Children,
    free_ports,
    fresh_folder,
    http_probe,
    shared_port,
)
from endpoint_picker.bench.targets import StackSpec, find_envoy, parse_targets
from endpoint_picker.datastore.decode import OBJECTIVE_P95_KEY

STARTUP_TIMEOUT = 60.0  # seconds for a whole stack to come up
FRONT_ADDRESS = "127.0.0.1"  # Envoy, the EPP and the routers
_EPP_CLUSTER = "endpoint_picker"  # the ext_proc cluster's name in deploy/envoy/templates
PRECISE_SCORER = "precise-prefix-cache-scorer"  # subscribes to the fleet's KV-cache events
_PYTHON = (sys.executable, "-m", "endpoint_picker")


@dataclass(frozen=True, slots=True)
class RunningStack:
    """A started stack. ``url``: the base URL clients send OpenAI requests to; ``server_urls``:
    each model server's base URL (``/metrics``); ``log_paths`` and ``pids`` per child name;
    ``epp_metrics_url``: the EPP's metrics port (``/metrics``), for the ``epp`` stacks only."""

    name: str
    url: str
    server_urls: tuple[str, ...]
    log_paths: Mapping[str, Path]
    pids: Mapping[str, int]
    folder: Path
    epp_metrics_url: str | None = None
    epp_metrics_urls: tuple[str, ...] = ()  # every replica's, the first one's first
    envoy_access_log: Path | None = None  # the front Envoy's (``envoytiming``), if Envoy


def pool_file(plan: WorkloadPlan, addresses: Sequence[str], port: int) -> str:
    """The EPP's pool file for the fleet: an InferencePool selecting the simulated pods, an
    InferenceModel per served name with the plan's criticality (and objective), and one Ready
    Pod per server."""
    served = (plan.base_model, *plan.adapters)
    unknown = sorted((set(plan.criticality) | set(plan.objectives)) - set(served))
    if unknown:
        raise BenchError(
            f"criticality or objective given for models the fleet does not serve: {unknown}"
        )
    selector = {"app": "bench-sim"}
    labels = {**selector, "inference.networking.k8s.io/engine-type": "vllm"}
    models: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(served):
        spec: dict[str, Any] = {"modelName": name,
                                "criticality": plan.criticality.get(name, "Critical")}  # fmt: skip
        seconds = plan.objectives.get(name)
        if seconds is not None:
            spec["objective"] = {OBJECTIVE_P95_KEY: f"{seconds * 1000:g}ms"}
        models[f"model-{i}"] = spec
    return pool_file_text("bench", labels, port, models, addresses, "sim-", selector)


@contextlib.asynccontextmanager
async def running_stack(
    spec: StackSpec,
    fleet: FleetOptions,
    plan: WorkloadPlan,
    work_dir: Path,
    *,
    startup_timeout: float = STARTUP_TIMEOUT,
) -> AsyncIterator[RunningStack]:
    """Start ``spec``'s stack for ``plan``; stop every child on exit, whatever happens."""
    envoy = find_envoy() if spec.kind in ("rr", "lr", "epp") else ""
    peer = peers.require(spec.kind) if spec.kind in peers.PEERS else None
    folder = fresh_folder(work_dir, spec.name)
    deadline = asyncio.get_running_loop().time() + startup_timeout
    children = Children(spec.name, folder, deadline)
    addresses = fleet.addresses()
    port = shared_port(addresses)
    servers = tuple(f"http://{a}:{port}" for a in addresses)
    front_port, admin_port, *epp_ports = free_ports(2 + 3 * spec.replicas, FRONT_ADDRESS)
    url = f"http://{FRONT_ADDRESS}:{front_port}"
    access_log: Path | None = None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            sim = await children.start("sim", [*_PYTHON, "sim", *fleet.sim_args(plan, port)])
            epps: list[tuple[Child, int]] = []  # each replica and its metrics port
            if spec.kind == "epp":  # meanwhile: its first scrapes may fail, which it survives
                pool = folder / "pool.yaml"
                pool.write_text(pool_file(plan, addresses, port))
                config = epp_config(spec, fleet, folder)
                for i in range(spec.replicas):
                    ports = epp_ports[3 * i : 3 * i + 3]
                    name = "epp" if spec.replicas == 1 else f"epp{i + 1}"
                    epps.append(
                        (
                            await children.start(
                                name,
                                _epp_argv(spec, pool, ports, config, fleet.tokenizer),
                                dict(spec.epp_env),
                            ),
                            ports[2],
                        )
                    )
            for server in servers:
                await children.wait(sim, http_probe(session, f"{server}/health"))
            for epp, metrics_port in epps:  # before Envoy, whose first health check must pass
                health = f"http://{FRONT_ADDRESS}:{metrics_port}/healthz"
                await children.wait(epp, http_probe(session, health))
            if peer is not None:
                argv = peers.router_args(
                    peer, spec.policy or peers.DEFAULT_POLICY, worker_urls=list(servers),
                    host=FRONT_ADDRESS, port=front_port, metrics_port=admin_port,
                )  # fmt: skip
                front = await children.start(peer.name, [*peer.command, *argv], dict(peer.env))
                ready = http_probe(session, f"{url}/readiness", peers.readiness(len(servers)))
            else:
                config = folder / "envoy.yaml"
                access_log = folder / "envoy-access.log"
                text = _envoy_config(spec, addresses, port, front_port, admin_port, epp_ports[0::3])
                config.write_text(envoytiming.with_access_log(text, access_log))
                argv = [
                    envoy, "-c", str(config), "--disable-hot-restart", "--log-level", "warning",
                    "--file-flush-interval-msec", str(envoytiming.FLUSH_MS),
                ]  # fmt: skip
                front = await children.start("envoy", argv)
                ready = http_probe(session, f"http://{FRONT_ADDRESS}:{admin_port}/ready")
            await children.wait(front, ready)
            # The whole path answers (/v1/models touches no model server's cache).
            await children.wait(front, http_probe(session, f"{url}/v1/models"))
        yield RunningStack(
            name=spec.name,
            url=url,
            server_urls=servers,
            log_paths={c.name: c.log_path for c in children.all},
            pids={c.name: c.proc.pid for c in children.all},
            folder=folder,
            epp_metrics_url=(
                f"http://{FRONT_ADDRESS}:{epp_ports[2]}" if spec.kind == "epp" else None
            ),
            epp_metrics_urls=tuple(f"http://{FRONT_ADDRESS}:{port}" for _, port in epps),
            envoy_access_log=access_log,
        )
        # A child that died during the run made its results meaningless: say so, loudly.
        if (gone := children.exited()) is not None:
            await children.fail(gone, f"exited during the run (status {gone.proc.returncode})")
    finally:
        await children.stop()


def _load_config(config_file: Path | None) -> object:
    """An EndpointPickerConfig file's document; None when there is none or it does not parse
    (the EPP then says why, at its start)."""
    if config_file is None:
        return None
    try:
        return yaml.safe_load(config_file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None


def precise_scorers(doc: object) -> list[dict[str, Any]]:
    """The ``precise-prefix-cache-scorer`` entries of a config document (mutable, in place)."""
    plugins = doc.get("plugins") if isinstance(doc, dict) else None
    return [p for p in plugins or () if isinstance(p, dict) and p.get("type") == PRECISE_SCORER]


def check_fleet(spec: StackSpec, fleet: FleetOptions) -> None:
    """``BenchError`` when ``spec``'s EPP config needs what the fleet does not give: the
    precise scorer needs the fleet's events (``--kv-events``) and its tokenizer
    (``--tokenizer``); with ``--kv-events-endpoint`` the one EPP process binds it, so neither
    replicas nor workers (each would bind the same endpoint)."""
    if spec.kind != "epp" or not precise_scorers(_load_config(spec.config_file)):
        return
    if not fleet.kv_events:
        raise BenchError(f"--stack {spec.name}: {PRECISE_SCORER} needs the fleet's KV-cache "
                         "events: add --kv-events (or --kv-events-endpoint)")  # fmt: skip
    if fleet.tokenizer is None:
        raise BenchError(f"--stack {spec.name}: {PRECISE_SCORER} needs the fleet's tokenizer: "
                         "add --tokenizer build (or PATH)")  # fmt: skip
    if fleet.kv_events_endpoint and (spec.replicas > 1 or spec.workers > 1):
        raise BenchError(f"--stack {spec.name}: with --kv-events-endpoint one EPP process binds "
                         "it: no replicas (Nx) or workers (@wN)")  # fmt: skip


def epp_config(spec: StackSpec, fleet: FleetOptions, folder: Path) -> Path | None:
    """The config file the stack's EPP runs with: ``spec.config_file`` as it is, or, when it
    has a ``precise-prefix-cache-scorer``, a copy in ``folder`` whose ``kvEventsConfig`` reaches
    this fleet's publishers: each server's port ``KV_EVENTS_PORT`` and replay port next to it,
    or, with ``--kv-events-endpoint``, that endpoint bound by the EPP (``zmqEndpoint``). Its
    other parameters (block size, topic filter, bounds) stay the config's own."""
    check_fleet(spec, fleet)
    doc = _load_config(spec.config_file)
    scorers = precise_scorers(doc)
    if spec.config_file is None or not scorers:
        return spec.config_file
    for plugin in scorers:
        params = plugin.get("parameters")
        params = plugin["parameters"] = params if isinstance(params, dict) else {}
        old = params.get("kvEventsConfig")
        events = {
            k: v
            for k, v in (old if isinstance(old, dict) else {}).items()
            if k not in ("socketPort", "zmqEndpoint", "discoverPods", "podDiscoveryConfig",
                         "replayPort")
        }  # fmt: skip
        if fleet.kv_events_endpoint:
            events["zmqEndpoint"] = fleet.kv_events_endpoint
        else:
            events["socketPort"] = KV_EVENTS_PORT
        events["replayPort"] = KV_EVENTS_PORT + 1
        params["kvEventsConfig"] = events
    path = folder / "epp-config.yaml"
    path.write_text(
        f"# {spec.config_file}, its {PRECISE_SCORER} subscribed to the bench's fleet\n"
        + yaml.safe_dump(doc, sort_keys=False),
        encoding="utf-8",
    )
    return path


def _epp_argv(
    spec: StackSpec,
    pool: Path,
    ports: Sequence[int],
    config_file: Path | None = None,
    tokenizer: str | None = None,
) -> list[str]:
    """``epp serve`` for one replica: ``config_file`` (``epp_config``), and the fleet's
    ``tokenizer`` for every model of the pool, so prompts become the ids the fleet caches."""
    grpc, health, metrics = ports
    # Warnings only (per-request logs would cost the fleet CPU); nothing to drain after a run.
    argv = [*_PYTHON, "serve", "--pool-file", str(pool), "--bind-address", FRONT_ADDRESS,
            "--grpc-port", str(grpc), "--grpc-health-port", str(health),
            "--metrics-port", str(metrics), "--log-level", "warning",
            "--drain-timeout", "1s"]  # fmt: skip
    if config_file is not None:
        argv += ["--config-file", str(config_file)]
    if tokenizer is not None:
        argv += ["--tokenizer", tokenizer]
    if spec.workers > 1:
        argv += ["--workers", str(spec.workers)]
    if spec.worker_max_requests > 0:
        argv += ["--worker-max-requests", str(spec.worker_max_requests)]
    if spec.plaintext:
        argv += ["--secure-serving", "false"]
    return argv


def _envoy_config(
    spec: StackSpec,
    addresses: Sequence[str],
    port: int,
    listen: int,
    admin: int,
    epps: Sequence[int],
) -> str:
    if spec.kind == "epp":
        text = envoy_config.render(
            "reference", listen_address=FRONT_ADDRESS, listen_port=listen,
            admin_address=FRONT_ADDRESS, admin_port=admin, epp_address=FRONT_ADDRESS,
            epp_port=epps[0], epp_tls=not spec.plaintext,
            ext_proc_graceful_close=spec.graceful_close,
        )  # fmt: skip
        return text if len(epps) == 1 else _more_epps(text, epps)
    endpoints = [(a, port) for a in addresses]
    return render_direct(spec.kind, endpoints=endpoints, listen_port=listen, admin_port=admin)


def _more_epps(text: str, epp_ports: Sequence[int]) -> str:
    """The rendered config with one ext_proc endpoint per EPP replica: Envoy balances the
    ext_proc streams (one per request) over them round robin."""
    config = yaml.safe_load(text)
    clusters = config["static_resources"]["clusters"]
    (cluster,) = [c for c in clusters if c["name"] == _EPP_CLUSTER]
    (locality,) = cluster["load_assignment"]["endpoints"]
    (first,) = locality["lb_endpoints"]
    locality["lb_endpoints"] = []
    for epp_port in epp_ports:
        endpoint = copy.deepcopy(first)
        endpoint["endpoint"]["address"]["socket_address"]["port_value"] = epp_port
        locality["lb_endpoints"].append(endpoint)
    return str(yaml.safe_dump(config, sort_keys=False))


__all__ = [
    "PRECISE_SCORER",
    "STARTUP_TIMEOUT",
    "RunningStack",
    "StackSpec",
    "check_fleet",
    "epp_config",
    "find_envoy",
    "parse_targets",
    "pool_file",
    "running_stack",
]
