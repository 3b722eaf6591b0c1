"""Simulator configuration: frozen dataclasses built once by the CLI, and GPU profiles.

Times in the step model are microseconds of *simulated* GPU time; everything else is seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal


@dataclass(frozen=True, slots=True)
class Profile:
    """Cost of one engine step, fitted to a model on a GPU.

    step_us = base_us + max(prefill_floor_us, prefill_us_per_token * prefill_tokens)
              + decode_us_per_context_token * decode_context_tokens + us_per_request * requests
    The floor is the forward pass over the weights, paid whether 1 or 200 tokens are prefilled;
    the context term is attention reading the KV cache of every decoding request.
    """

    name: str
    base_us: float
    prefill_floor_us: float
    prefill_us_per_token: float
    decode_us_per_context_token: float
    us_per_request: float
    num_gpu_blocks: int
    block_size: int = 16
    max_model_len: int = 131072

    def step_us(self, prefill_tokens: int, decode_context_tokens: int, requests: int) -> float:
        """Simulated duration of one step, in microseconds."""
        return (
            self.base_us
            + max(self.prefill_floor_us, self.prefill_us_per_token * prefill_tokens)
            + self.decode_us_per_context_token * decode_context_tokens
            + self.us_per_request * requests
        )


# Llama-3.1-8B-Instruct (bf16) on vLLM on one H100 80GB: the coefficients the simulator's
# specification gives, with vLLM's KV cache size for that setup.
_H100 = Profile(
    name="llama-3.1-8b-h100",
    base_us=1150.0,
    prefill_floor_us=5680.0,
    prefill_us_per_token=30.0,
    decode_us_per_context_token=0.076,
    us_per_request=4.4,
    num_gpu_blocks=27000,
)
# An estimate, not a measurement: the H100 profile scaled to an A100 80GB by memory bandwidth
# (3.35/2.04 TB/s) for the weight- and KV-bound terms and by bf16 FLOPs (989/312) for
# prefill; same memory, so the same KV capacity.
_A100 = replace(
    _H100,
    name="llama-3.1-8b-a100",
    prefill_floor_us=9330.0,
    prefill_us_per_token=95.0,
    decode_us_per_context_token=0.125,
)
PROFILES: dict[str, Profile] = {p.name: p for p in (_H100, _A100)}
DEFAULT_PROFILE = "llama-3.1-8b-h100"


@dataclass(frozen=True, slots=True)
class LoraModule:
    """A LoRA adapter known at start-up (vLLM ``--lora-modules name=path``)."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What one simulated vLLM engine is: scheduler limits, KV cache, LoRA, speed."""

    profile: Profile = PROFILES[DEFAULT_PROFILE]
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_gpu_blocks: int = 27000
    block_size: int = 16
    max_model_len: int = 131072
    max_loras: int = 2
    lora_load_ms: float = 25.0
    # 2.0 runs the simulated GPU twice as fast as real time.
    time_scale: float = 1.0
    # This server's GPU against the profile: 0.5 makes every step (prefill, decode, adapter
    # loads) take twice as long. Unlike time_scale it changes simulated time, so /metrics shows it.
    speed: float = 1.0

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds when full."""
        return self.num_gpu_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """Failure injection, drawn from one seeded random source per server."""

    failure_rate: float = 0.0
    failure_codes: tuple[int, ...] = (429, 503)
    metrics_delay_ms: float = 0.0
    metrics_failure_rate: float = 0.0


# vLLM's KV-event wire generations: "current" is vLLM >= v0.26 (events as maps keyed "type",
# vllm-project/vllm#42892; replay replies carry the topic, #45177), "legacy" before (events as
# tagged positional arrays; replay replies without the topic).
Wire = Literal["current", "legacy"]
WIRES: tuple[Wire, ...] = ("current", "legacy")


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """vLLM's ``--kv-events-config`` (``KVEventsConfig``), as the simulator publishes it.

    ``endpoint``, ``replay_endpoint`` and ``topic`` may hold a tcp wildcard or ``${POD_IP}``:
    each server of the process substitutes its own address (``kvpublisher.for_server``).
    """

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000  # vLLM's publisher-thread queue; the simulator has none
    topic: str = ""
    wire: Wire = "current"

    @property
    def encoding(self) -> Literal["map", "array"]:
        """How events are laid out in the batch."""
        return "map" if self.wire == "current" else "array"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """One simulated vLLM server: what it serves and how it answers."""

    model: str
    lora_modules: tuple[LoraModule, ...] = ()
    engine: EngineConfig = field(default_factory=EngineConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    # Tokens per SSE chunk after the first, like vLLM's --stream-interval.
    stream_interval: int = 1
    # Completions default to 16 like vLLM; chat defaults to this (vLLM would allow the whole
    # remaining context, which makes an unbounded simulated request by accident).
    default_chat_max_tokens: int = 128
    seed: int | None = None
    # Publish KV-cache events (None: off, as vLLM's default).
    kv_events: KvEventsConfig | None = None
    # A Hugging Face tokenizer.json; None: the approximate 4-characters-per-token tokenizer.
    tokenizer: str | None = None


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The whole process: N servers on consecutive loopback addresses, one port."""

    server: ServerConfig
    servers: int = 1
    address: str = "127.0.0.2"
    port: int = 8000
    # One speed factor per server (EngineConfig.speed); empty means all 1.0.
    speeds: tuple[float, ...] = ()

    def server_config(self, index: int) -> ServerConfig:
        """Server ``index``'s config: the shared one with its own speed."""
        if not self.speeds:
            return self.server
        return replace(self.server, engine=replace(self.server.engine, speed=self.speeds[index]))
