"""``epp sim``: run simulated vLLM servers. ``main(argv)`` receives the words after ``sim``."""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import json
import logging
import math
import signal
import sys
from dataclasses import replace
from typing import NoReturn

import zmq

from endpoint_picker_sim.cluster import addresses, running_servers
from endpoint_picker_sim.config import (
    DEFAULT_PROFILE,
    PROFILES,
    WIRES,
    EngineConfig,
    FaultConfig,
    KvEventsConfig,
    LoraModule,
    ServerConfig,
    SimConfig,
    Wire,
)
from endpoint_picker_sim.tokenids import HfTokenIds

log = logging.getLogger("endpoint_picker_sim")


class UsageError(Exception):
    """A bad flag: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="epp sim", description="Run simulated vLLM model servers.")
    a = p.add_argument
    a("--servers", type=int, default=1, help="servers in this process (one event loop)")
    a("--address", "--host", dest="address", default="127.0.0.2",
      help="first server's address; the others take the next ones")  # fmt: skip
    a("--port", type=int, default=8000)
    a("--model", required=True, help="base model name, as served")
    a("--lora-modules", nargs="+", action="extend", default=[],
      help="adapters: name or name=path, space- or comma-separated")  # fmt: skip
    a("--enable-lora", action="store_true", help="accepted for vLLM compatibility")
    a("--max-loras", type=int, default=2, help="adapters in one batch at once")
    a("--lora-load-ms", type=float, default=25.0, help="cost of bringing an adapter in")
    a("--max-num-seqs", type=int, default=256)
    a("--max-num-batched-tokens", type=int, default=8192)
    a("--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks", type=int)
    a("--block-size", type=int, default=16)
    a("--max-model-len", type=int)
    a("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    a("--step-base-us", type=float, help="override the profile's fixed step cost")
    a("--prefill-floor-us", type=float, help="override the forward-pass floor")
    a("--prefill-us-per-token", type=float)
    a("--decode-us-per-context-token", type=float)
    a("--us-per-request", type=float)
    a("--time-scale", type=float, default=1.0, help="simulated clock speed (2.0 = 2x real time)")
    a("--server-speeds", default="",
      help="GPU speed per server, comma-separated (0.5 = steps take 2x as long)")  # fmt: skip
    a("--stream-interval", type=int, default=1, help="tokens per SSE chunk after the first")
    a("--chat-max-tokens", type=int, default=128, help="chat max_tokens when the request has none")
    a("--failure-rate", type=float, default=0.0)
    a("--failure-codes", default="429,503")
    a("--metrics-delay-ms", type=float, default=0.0)
    a("--metrics-failure-rate", type=float, default=0.0)
    a("--seed", type=int)
    a("--tokenizer", help="a Hugging Face tokenizer.json: real token ids (default: 4 chars/token)")
    a("--kv-events-config",
      help="vLLM's KV-event publisher config, JSON (enable_kv_cache_events, publisher, endpoint, "
           "replay_endpoint, buffer_steps, hwm, max_queue_size, topic)")  # fmt: skip
    a("--kv-events-port", type=int,
      help="publish KV events on tcp://<server>:PORT, replay on PORT+1, topic "
           "kv@<server>@<model> (shorthand for --kv-events-config)")  # fmt: skip
    a("--kv-events-wire", default="current", choices=WIRES,
      help="current: vLLM >= 0.26 (events as maps); legacy: tagged positional arrays")  # fmt: skip
    a("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _loras(values: list[str]) -> tuple[LoraModule, ...]:
    out: dict[str, LoraModule] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            # vLLM's JSON form: {"name": ..., "path": ..., "base_model_name": ...}
            try:
                spec = json.loads(value)
                out[spec["name"]] = LoraModule(str(spec["name"]), str(spec["path"]))
            except (ValueError, KeyError, TypeError):
                raise UsageError(f"--lora-modules: bad JSON entry {value!r}") from None
            continue
        for item in filter(None, (part.strip() for part in value.split(","))):
            name, sep, path = item.partition("=")
            if not name or (sep and not path):
                raise UsageError(f"--lora-modules: bad entry {item!r} (use name or name=path)")
            out[name] = LoraModule(name, path or f"/adapters/{name}")
    return tuple(out.values())


_KV_KEYS = frozenset(
    ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
     "max_queue_size", "topic")
)  # fmt: skip


def kv_events_config(text: str, wire: Wire) -> KvEventsConfig | None:
    """vLLM's ``--kv-events-config`` JSON -> a config, or None when events stay off."""
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--kv-events-config: not JSON: {exc}") from None
    _check(isinstance(spec, dict), "--kv-events-config must be a JSON object")
    unknown = sorted(set(spec) - _KV_KEYS)
    _check(not unknown, f"--kv-events-config: unknown field(s) {unknown}")
    enabled = spec.get("enable_kv_cache_events", False)
    _check(isinstance(enabled, bool), "--kv-events-config: enable_kv_cache_events must be a bool")
    publisher = spec.get("publisher") or ("zmq" if enabled else "null")
    _check(publisher in ("zmq", "null"), f"--kv-events-config: unknown publisher {publisher!r}")
    if not enabled or publisher == "null":
        return None
    defaults = KvEventsConfig()
    values: dict[str, object] = {}
    for key in ("endpoint", "topic"):
        value = spec.get(key, getattr(defaults, key))
        _check(isinstance(value, str), f"--kv-events-config: {key} must be a string")
        values[key] = value
    replay = spec.get("replay_endpoint")
    _check(replay is None or isinstance(replay, str),
           "--kv-events-config: replay_endpoint must be a string or null")  # fmt: skip
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        value = spec.get(key, getattr(defaults, key))
        _check(type(value) is int and value >= 1,
               f"--kv-events-config: {key} must be a positive integer")  # fmt: skip
        values[key] = value
    endpoint = str(values["endpoint"])
    _check(endpoint.startswith(("tcp://", "ipc://", "inproc://")),
           f"--kv-events-config: endpoint must be tcp, ipc or inproc: {endpoint!r}")  # fmt: skip
    return KvEventsConfig(
        endpoint=endpoint,
        replay_endpoint=replay,
        buffer_steps=int(str(values["buffer_steps"])),
        hwm=int(str(values["hwm"])),
        max_queue_size=int(str(values["max_queue_size"])),
        topic=str(values["topic"]),
        wire=wire,
    )


def _kv_events(ns: argparse.Namespace) -> KvEventsConfig | None:
    if ns.kv_events_config is not None and ns.kv_events_port is not None:
        raise UsageError("give --kv-events-config or --kv-events-port, not both")
    if ns.kv_events_config is not None:
        return kv_events_config(ns.kv_events_config, ns.kv_events_wire)
    if ns.kv_events_port is None:
        return None
    port = ns.kv_events_port
    _check(1 <= port <= 65534, f"--kv-events-port out of range: {port}")
    return KvEventsConfig(
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{port + 1}",
        topic=f"kv@${{POD_IP}}@{ns.model}",
        wire=ns.kv_events_wire,
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def parse_speeds(text: str, servers: int) -> tuple[float, ...]:
    """``--server-speeds 1,1,0.5`` -> one positive finite factor per server; "" -> all 1.0."""
    if not text.strip():
        return (1.0,) * servers
    try:
        speeds = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--server-speeds: not a list of numbers: {text!r}") from None
    _check(len(speeds) == servers,
           f"--server-speeds has {len(speeds)} factor(s) for {servers} server(s)")  # fmt: skip
    _check(all(0 < s < math.inf for s in speeds),
           f"--server-speeds factors must be positive and finite, got {text!r}")  # fmt: skip
    return speeds


def build_config(argv: list[str]) -> SimConfig:
    """Flags -> ``SimConfig``; raises ``UsageError`` with a one-line reason."""
    return _config(_parser().parse_args(argv))


def _config(ns: argparse.Namespace) -> SimConfig:
    profile = PROFILES[ns.profile]
    overrides = {
        "base_us": ns.step_base_us,
        "prefill_floor_us": ns.prefill_floor_us,
        "prefill_us_per_token": ns.prefill_us_per_token,
        "decode_us_per_context_token": ns.decode_us_per_context_token,
        "us_per_request": ns.us_per_request,
    }
    for key, value in overrides.items():
        if value is not None:
            _check(value >= 0, f"--{key.replace('_', '-')} must not be negative")
            profile = replace(profile, **{key: value})
    blocks = ns.num_gpu_blocks if ns.num_gpu_blocks is not None else profile.num_gpu_blocks
    for flag, value in (("--servers", ns.servers), ("--max-loras", ns.max_loras),
                        ("--max-num-seqs", ns.max_num_seqs), ("--num-gpu-blocks", blocks),
                        ("--max-num-batched-tokens", ns.max_num_batched_tokens),
                        ("--block-size", ns.block_size), ("--stream-interval", ns.stream_interval),
                        ("--chat-max-tokens", ns.chat_max_tokens)):  # fmt: skip
        _check(value >= 1, f"{flag} must be at least 1, got {value}")
    _check(0 <= ns.port <= 65535, f"--port out of range: {ns.port}")
    _check(ns.time_scale > 0, "--time-scale must be positive")
    speeds = parse_speeds(ns.server_speeds, ns.servers)
    for flag, rate in (("--failure-rate", ns.failure_rate),
                       ("--metrics-failure-rate", ns.metrics_failure_rate)):  # fmt: skip
        _check(0.0 <= rate <= 1.0, f"{flag} must be within [0, 1], got {rate}")
    _check(ns.metrics_delay_ms >= 0 and ns.lora_load_ms >= 0, "delays must not be negative")
    try:
        codes = tuple(int(c) for c in ns.failure_codes.split(",") if c.strip())
    except ValueError:
        raise UsageError(f"--failure-codes: not a list of integers: {ns.failure_codes!r}") from None
    _check(bool(codes) and all(400 <= c <= 599 for c in codes),
           "--failure-codes must list HTTP error codes (400-599)")  # fmt: skip
    try:
        ipaddress.IPv4Address(ns.address)
        addresses(ns.address, ns.servers)
    except ValueError as exc:
        raise UsageError(f"--address: {exc}") from None
    capacity = blocks * ns.block_size
    max_len = ns.max_model_len or min(profile.max_model_len, capacity)
    _check(max_len <= capacity,
           f"--max-model-len {max_len} exceeds the KV cache ({capacity} tokens)")  # fmt: skip
    engine = EngineConfig(
        profile=profile,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        num_gpu_blocks=blocks,
        block_size=ns.block_size,
        max_model_len=max_len,
        max_loras=ns.max_loras,
        lora_load_ms=ns.lora_load_ms,
        time_scale=ns.time_scale,
    )
    faults = FaultConfig(ns.failure_rate, codes, ns.metrics_delay_ms, ns.metrics_failure_rate)
    server = ServerConfig(
        model=ns.model,
        lora_modules=_loras(ns.lora_modules),
        engine=engine,
        faults=faults,
        stream_interval=ns.stream_interval,
        default_chat_max_tokens=ns.chat_max_tokens,
        seed=ns.seed,
        kv_events=_kv_events(ns),
        tokenizer=_tokenizer(ns.tokenizer),
    )
    return SimConfig(
        server=server, servers=ns.servers, address=ns.address, port=ns.port, speeds=speeds
    )


def _tokenizer(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        HfTokenIds(path)
    except ValueError as exc:
        raise UsageError(f"--tokenizer: {exc}") from None
    return path


async def serve(sim: SimConfig) -> None:
    """Run until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with running_servers(sim) as servers:
            cfg = sim.server
            adapters = ",".join(m.name for m in cfg.lora_modules) or "-"
            for server in servers:
                log.info(
                    "sim listening on %s model=%s adapters=%s profile=%s blocks=%dx%d "
                    "max_num_seqs=%d time_scale=%g speed=%g",
                    server.url, cfg.model, adapters, cfg.engine.profile.name,
                    cfg.engine.num_gpu_blocks, cfg.engine.block_size, cfg.engine.max_num_seqs,
                    cfg.engine.time_scale, server.config.engine.speed,
                )  # fmt: skip
                if (pub := server.publisher) is not None:
                    log.info("sim %s KV events on %s (%s) replay=%s topic=%r wire=%s", server.url,
                             pub.endpoint, "bind" if pub.binds else "connect",
                             pub.replay_endpoint, pub.topic.decode(), pub.config.wire)  # fmt: skip
            # Everything built so far (notably each engine's block tables) lives as long as the
            # process; freezing it keeps the collector from rescanning it, which otherwise
            # pauses every engine of the process for milliseconds at a time.
            gc.collect()
            gc.freeze()
            await stop.wait()
            log.info("sim stopping %d server(s)", len(servers))
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        _parser().print_help()
        return 0
    try:
        ns = _parser().parse_args(args)
        sim = _config(ns)
    except UsageError as exc:
        print(f"epp sim: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=ns.log_level, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr
    )
    try:
        asyncio.run(serve(sim))
    except OSError as exc:
        print(f"epp sim: error: cannot listen: {exc}", file=sys.stderr)
        return 1
    except zmq.ZMQError as exc:
        print(f"epp sim: error: cannot open the KV-event sockets: {exc}", file=sys.stderr)
        return 1
    return 0
