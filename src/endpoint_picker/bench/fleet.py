"""The simulated fleet every ``epp bench`` stack routes to: its options, as ``epp sim`` flags.

One ``epp sim`` process serves ``servers`` simulated vLLM servers on consecutive loopback
addresses from ``FLEET_ADDRESS`` (127.0.0.2 and up), one port for all; ``running_stack``
(``stacks``) starts it in front of whatever routes to it.
"""

from __future__ import annotations

import ipaddress
import json
import math
from dataclasses import dataclass

from endpoint_picker.bench.model import BenchError, WorkloadPlan

FLEET_ADDRESS = "127.0.0.2"  # the first simulated server; the others take the next addresses
# With --kv-events each simulated server publishes on <its address>:KV_EVENTS_PORT (vLLM's
# default port) and replays on the next port, topic kv@<its address>@<base model>; with
# --kv-events-endpoint every server connects there instead (the subscriber binds it).
KV_EVENTS_PORT = 5557


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """The simulated fleet of every stack (``epp sim`` flags; ``None``: the simulator's default).

    ``servers`` run in one ``epp sim`` process on consecutive addresses from ``FLEET_ADDRESS``.
    ``extra_args`` are appended to the ``epp sim`` command line as they are.
    """

    servers: int = 4
    profile: str | None = None
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_loras: int | None = None
    time_scale: float = 1.0
    # 8 tokens per SSE chunk after the first (the first comes at once, so TTFT is exact):
    # a chunk per token costs the fleet, Envoy and the client several times the CPU, which this
    # 2-core machine does not have (docs/sim.md)
    stream_interval: int | None = 8
    # One GPU speed factor per server (``epp sim --server-speeds``); None: all 1.0.
    server_speeds: tuple[float, ...] | None = None
    # A tokenizer.json for the fleet (``epp sim --tokenizer``); None: the approximate tokenizer.
    tokenizer: str | None = None
    # Publish vLLM's KV-cache events (``epp sim --kv-events-port KV_EVENTS_PORT``), in this wire.
    kv_events: bool = False
    kv_events_wire: str = "current"
    kv_events_endpoint: str | None = None  # connect mode: the one endpoint every server dials
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.servers <= 200:  # 127.0.0.2 .. 127.0.0.201
            raise BenchError(f"--servers must be in 1..200: {self.servers}")
        if self.time_scale <= 0:
            raise BenchError(f"--time-scale must be positive: {self.time_scale}")
        endpoint = self.kv_events_endpoint
        if endpoint is not None and (not endpoint.startswith("tcp://") or "*" in endpoint):
            raise BenchError(f"--kv-events-endpoint must be tcp://HOST:PORT: {endpoint!r}")
        speeds = self.server_speeds
        if speeds is not None:
            if len(speeds) != self.servers:
                raise BenchError(
                    f"--server-speeds has {len(speeds)} factor(s) for {self.servers} server(s)"
                )
            if not all(0 < s < math.inf for s in speeds):
                raise BenchError(f"--server-speeds factors must be positive and finite: {speeds}")

    def sim_args(self, plan: WorkloadPlan, port: int) -> list[str]:
        """The words after ``epp sim`` for a fleet serving ``plan``'s models on ``port``."""
        args = ["--servers", str(self.servers), "--address", FLEET_ADDRESS, "--port", str(port),
                "--model", plan.base_model]  # fmt: skip
        if plan.adapters:
            args += ["--lora-modules", *plan.adapters]
        optional = {
            "--profile": self.profile,
            "--num-gpu-blocks": self.num_gpu_blocks,
            "--max-num-seqs": self.max_num_seqs,
            "--max-loras": self._max_loras(plan),
            "--stream-interval": self.stream_interval,
            "--server-speeds": (
                None if self.server_speeds is None else ",".join(map(str, self.server_speeds))
            ),
            "--tokenizer": self.tokenizer,
            "--kv-events-port": (
                KV_EVENTS_PORT if self.kv_events and not self.kv_events_endpoint else None
            ),
            "--kv-events-config": self._kv_events_config(plan),
            "--kv-events-wire": self.kv_events_wire if self.kv_events else None,
        }
        for flag, value in optional.items():
            if value is not None:
                args += [flag, str(value)]
        return [*args, "--time-scale", str(self.time_scale), *self.extra_args]

    def _kv_events_config(self, plan: WorkloadPlan) -> str | None:
        """Connect mode, as llm-d deploys it: every pod dials one endpoint the subscriber binds."""
        if not self.kv_events or not self.kv_events_endpoint:
            return None
        return json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": self.kv_events_endpoint,
            "replay_endpoint": f"tcp://*:{KV_EVENTS_PORT + 1}",
            "topic": f"kv@${{POD_IP}}@{plan.base_model}",
        })  # fmt: skip

    def _max_loras(self, plan: WorkloadPlan) -> int | None:
        """``max_loras``, or, for a plan whose criticality classes are adapters
        (``mixed-criticality``), a slot for each: slot contention would otherwise drown the
        criticality effect that workload is about."""
        if self.max_loras is None and plan.criticality:
            return max(3, len(plan.adapters))
        return self.max_loras

    def addresses(self) -> list[str]:
        """Each server's address, as ``epp sim --servers N --address FLEET_ADDRESS`` binds them."""
        first = ipaddress.IPv4Address(FLEET_ADDRESS)
        return [str(first + i) for i in range(self.servers)]
