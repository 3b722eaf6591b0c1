"""The value types every part of ``epp bench`` shares.

A workload is a list of ``RequestSpec`` (what to send, and when); the client turns each into a
``RequestRecord`` (what happened); ``fleetwatch`` produces a ``FleetObservation`` per target; a
``TargetResult`` bundles them with the target's name and the rate it ran at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from endpoint_picker.errors import EppError


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, identical for every target of a run.

    ``at``: seconds after the start of the run at which it is sent. ``body`` is the OpenAI JSON
    body (``stream: true`` with ``stream_options.include_usage``); ``path`` its API path.
    ``group`` names the prefix group or chat session (for analysis), ``turn`` the chat turn.
    For a chat turn after the first, ``body``'s messages end with the user's new message and
    ``follows`` is the index of the previous turn of the same session: the client replaces the
    placeholder assistant message (``ASSISTANT_PLACEHOLDER``) with the previous turn's actual
    reply text before sending, so the conversation grows as a real one does.
    """

    index: int
    at: float
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    group: str = ""
    turn: int = 0
    follows: int | None = None
    expected_output_tokens: int = 0


ASSISTANT_PLACEHOLDER = "\x00previous-reply\x00"
# The EPP's flow id (its wire key, spelled here too: the bench imports nothing of the EPP's).
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
# Sent with every request so that Envoy's access log can be joined with the client's records.
INDEX_HEADER = "x-bench-index"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the client saw of one request. Times are seconds; ``None`` when not reached.

    ``sent_at`` is when it actually went out, relative to the run start (``spec.at`` is when it
    was due: the difference is the load generator's lag). ``ttft`` is from send to the first
    token, ``e2e`` from send to the last byte; ``tpot`` is ``(e2e - ttft) / (output_tokens - 1)``
    when more than one token came back. ``status`` 0 means no HTTP answer (connection error).
    """

    index: int
    due_at: float
    sent_at: float
    status: int
    ttft: float | None
    e2e: float | None
    output_tokens: int
    prompt_tokens: int
    error: str = ""
    reply_text: str = ""  # kept only for chat turns that a later turn follows
    model: str = ""  # the body's model (the served name), for per-model summaries
    tenant: str = ""  # the FAIRNESS_HEADER it carried, for per-tenant summaries

    @property
    def per_token(self) -> float | None:
        """The seed's objective metric: e2e latency / output tokens (queueing included)."""
        if self.e2e is None or self.output_tokens < 1:
            return None
        return self.e2e / self.output_tokens

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.e2e is not None


@dataclass(frozen=True, slots=True)
class ServerSample:
    """One scrape of one model server during a run (seconds since the run start)."""

    t: float
    waiting: float
    running: float
    kv_usage: float


@dataclass(frozen=True, slots=True)
class ServerObservation:
    """One model server over a run: counter deltas from start to end, gauges over time."""

    name: str  # host:port
    requests: int  # vllm:request_success_total delta
    prefix_cache_queries: float  # tokens
    prefix_cache_hits: float  # tokens
    samples: tuple[ServerSample, ...] = ()
    # the simulator's clock keeping, if it is one (sim:* series); None for a real server
    step_planned_seconds: float | None = None
    step_late_seconds: float | None = None
    step_behind_seconds: float | None = None
    # sim:prefix_cache_oracle_hits: tokens the longest prefix cached anywhere would have hit
    oracle_hits: float | None = None


@dataclass(frozen=True, slots=True)
class FleetObservation:
    servers: tuple[ServerObservation, ...]


@dataclass(frozen=True, slots=True)
class RouterTiming:
    """What the router added, as the Envoy in front of it logged it (``envoytiming``): p50,
    p90 and p99 in seconds of each interval, over ``requests`` measured requests."""

    requests: int
    to_upstream: tuple[float, float, float]  # end of the client's request -> upstream request
    to_client: tuple[float, float, float]  # first response byte -> first byte to the client


@dataclass(frozen=True, slots=True)
class TargetResult:
    """One target at one rate: everything the report needs, JSON-serialisable via ``report``."""

    target: str  # e.g. "rr", "epp", "epp=my.yaml", "sglang-router"
    workload: str
    rate: float  # requests per second asked for
    duration: float  # seconds of measured arrivals (after the warm-up)
    records: tuple[RequestRecord, ...]  # every request sent, warm-up included
    fleet: FleetObservation  # the servers' counters from the end of the warm-up
    notes: tuple[str, ...] = ()  # e.g. why the run is invalid
    warmup: float = 0.0  # seconds of arrivals before the measured ones: sent, not measured
    router: RouterTiming | None = None  # Envoy-fronted targets only


class BenchError(EppError):
    """A bench run cannot go on (missing extra or binary, a bad flag, a stack that won't start).

    The command prints its message on one line and exits 2.
    """


@dataclass(frozen=True, slots=True)
class WorkloadPlan:
    """A generated workload: the requests, and what the fleet must serve for them.

    ``base_model`` and ``adapters`` are what the simulated servers serve (``epp sim --model``,
    ``--lora-modules``): requests name these directly, so every target (round robin, the EPP,
    the peer routers) gets bodies its servers accept. ``criticality`` maps a served name to the
    InferenceModel criticality the EPP's pool file gives it (Critical when absent);
    ``objectives`` a served name to its latency objective, seconds per output token at P95
    (written into the pool file's InferenceModel; summarised per model by ``stats``).
    """

    workload: str
    params: dict[str, Any]
    requests: tuple[RequestSpec, ...]
    base_model: str
    adapters: tuple[str, ...] = ()
    criticality: dict[str, str] = field(default_factory=dict)
    objectives: dict[str, float] = field(default_factory=dict)
