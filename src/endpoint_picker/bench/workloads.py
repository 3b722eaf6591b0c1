"""The workloads ``epp bench`` can run, their parameters, and ``generate``, which makes a plan.

A plan is a pure function of (workload, parameters, rate, duration, seed, arrival, burstiness,
base model): generated once per run and sent unchanged to every target, so every router sees
the same requests, with the same text, at the same times. Content and timing draw from two
random streams of their own (``Random(f"{seed}:content")``, ``Random(f"{seed}:arrivals")``), so
a parameter that changes text never shifts arrivals, and nothing reads the global random state.

Why the defaults look as they do. The fleet is 4 ``epp sim`` servers on the default profile
(``llama-3.1-8b-h100``: 27,000 KV blocks of 16 tokens, 432,000 tokens of cache per server; 30 us
per prefilled token, so a 4,000-token prompt costs 120 ms of prefill and its cached repeat one
~7 ms step). The figures below replay 60 s of each plan (seed 1) on 4 of the simulator's engines
with a discrete-event clock, routed round robin (RR) or by a hash of the group ("affinity"), and
are what a router has to win:

- ``shared-prefix`` (200 groups x 4,000 tokens, uniform): the prefixes total 800,000 tokens,
  1.9x one server's cache but half the fleet's. RR makes every server hold every group, so it
  thrashes (41-47% of prompt tokens hit) and saturates near 30 requests/s; affinity keeps a
  quarter of the groups per server (83-92% hit) and at 50 requests/s still has a 31 ms median
  TTFT. With few groups (16 x 2,000 tokens = 32,000, which every server caches) RR hits 95% and
  routing cannot matter, so small G is a poor default.
- ``hot-prefix`` (same sizes, one group 50%): pure affinity piles half the traffic on one
  server and collapses at 40 requests/s (median TTFT 4 s) where RR still runs (83 ms); affinity
  that yields to load beats both (26 ms).
- ``chat`` (6 turns; 1,000-token system prompt, 200-token user messages, 250-token replies,
  3 s think time): contexts grow to ~3,500 tokens; sending a session back to its server raises
  the hit rate from 65% to 88% and at 60 requests/s halves the median e2e (4.9 s against 8.6 s).
- ``multi-lora`` (8 adapters, Zipf 1, 20% base; 1,000 + 100 prompt, 300 output tokens): a server
  runs at most ``--max-loras`` (2) adapters at once, so RR, which sends every adapter everywhere,
  leaves requests waiting for a slot (p90 TTFT 17 s at 25 requests/s against 19 ms by adapter).
- ``long-prefill`` (6,000 tokens +-50%, 32 out) and ``decode-heavy`` (200 in, 1,000 +-50% out):
  no shared prefixes, varied lengths: only load balancing helps, and a cache-aware router must
  not lose here. RR saturates near 18 and 50 requests/s.
- ``mixed-criticality`` (20% Critical, 40% Standard, 40% Sheddable; 32 groups x 2,000 tokens,
  300 out): the sheddable share exceeds the excess of a 1.3x overload (23%), so shedding it can
  keep Critical and Standard within capacity (RR saturates near 65 requests/s). Its three served
  names are adapters: run the fleet with ``--max-loras 3`` or more, or slot waits (p90 TTFT 41 s
  at 40 requests/s with 2 slots) drown the criticality effect.
- ``two-tenants`` (75% ``heavy``, 25% ``light``, one Standard model; 3,000 unique tokens in,
  200 out): the step model puts 2 servers' capacity near 14 requests/s (KV-bound: ~135 such
  requests fit one server's cache, ~95 ms steps), an estimate not yet measured (the same
  arithmetic gives ~33/s for mixed-criticality on 2 servers, where ~28 was measured). At 28/s
  ``light`` alone asks for half of what the fleet completes or more: round-robin fairness
  should give it about half of the dispatches, global FIFO its 25% of the arrivals.

Long prompts and outputs keep RR's saturation between about 18 and 65 requests/s everywhere:
each request is real GPU work, so the 2 cores that also run the load generator, Envoy and the
router are less likely than the simulated GPUs to be the bottleneck.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from endpoint_picker.bench import builders, sessions
from endpoint_picker.bench.arrivals import arrival_times, check_arrival
from endpoint_picker.bench.model import BenchError, RequestSpec, WorkloadPlan
from endpoint_picker.bench.prompts import TextSource

DEFAULT_BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True, slots=True)
class Param:
    """One ``--param name=value``; its type is its default's (int or float); bounds inclusive."""

    name: str
    default: int | float
    help: str
    minimum: float = 0.0
    maximum: float | None = None

    def parse(self, raw: str) -> int | float:
        """The value of ``raw``, or ``BenchError`` saying what was expected."""
        is_int = isinstance(self.default, int)
        try:
            value: int | float = int(raw) if is_int else float(raw)
        except ValueError:
            kind = "an integer" if is_int else "a number"
            raise BenchError(f"--param {self.name}={raw}: expected {kind}") from None
        if not math.isfinite(value):
            raise BenchError(f"--param {self.name}={raw}: must be a finite number")
        if value < self.minimum:
            raise BenchError(f"--param {self.name}={raw}: must be at least {self.minimum:g}")
        if self.maximum is not None and value > self.maximum:
            raise BenchError(f"--param {self.name}={raw}: must be at most {self.maximum:g}")
        return value


@dataclass(frozen=True, slots=True)
class WorkloadInfo:
    """What ``epp bench workloads`` lists, and the builder behind it."""

    name: str
    description: str
    params: tuple[Param, ...]
    build: Callable[[builders.Context], builders.Built] = field(repr=False, compare=False)


def _groups(default: int, minimum: int = 1) -> Param:
    return Param("groups", default, "prefix groups (distinct system prompts)", minimum)


def _tokens(name: str, default: int, what: str, minimum: int = 1) -> Param:
    return Param(name, default, what, minimum)


def _prefixed(
    prompt: int, question: int, output: int, prompt_is: str = "the shared prefix"
) -> tuple[Param, Param, Param]:
    """The token counts of a request made of a system prompt, a question of its own and an
    answer: the prefix workloads' shape."""
    return (
        _tokens("prompt_tokens", prompt, f"system prompt tokens ({prompt_is})"),
        _tokens("question_tokens", question, "question tokens (unique per request)"),
        _tokens("output_tokens", output, "output tokens per request"),
    )


_SKEW_HELP = "Zipf exponent of popularity: 0 uniform, 1 classic Zipf, higher hotter"

_INFOS = (
    WorkloadInfo(
        "shared-prefix",
        "groups of requests share a long system prompt; cache-aware routing pays off",
        (
            _groups(200),
            Param("skew", 0.0, _SKEW_HELP, 0.0, 10.0),
            *_prefixed(4000, 50, 150),
        ),
        builders.shared_prefix,
    ),
    WorkloadInfo(
        "hot-prefix",
        "one prefix group carries half the traffic: the hot-spot trap of cache-aware routers",
        (
            _groups(200, minimum=2),
            Param("hot_share", 0.5, "share of requests in the hot group", 0.0, 1.0),
            *_prefixed(4000, 50, 150),
        ),
        builders.hot_prefix,
    ),
    WorkloadInfo(
        "chat",
        "multi-turn sessions whose context grows each turn (x-session-id); session affinity",
        (
            Param("turns", 6, "turns per session", 1),
            _tokens("system_tokens", 1000, "system prompt tokens, one for all sessions", 0),
            _tokens("user_tokens", 200, "tokens of each user message"),
            _tokens("output_tokens", 250, "tokens of each reply"),
            Param("think_time", 3.0, "seconds a user thinks after a reply (see sessions)"),
        ),
        sessions.chat,
    ),
    WorkloadInfo(
        "multi-lora",
        "requests spread over LoRA adapters adapter-0..N-1 (Zipf) and the base model",
        (
            Param("adapters", 8, "LoRA adapters served", 1),
            Param("skew", 1.0, _SKEW_HELP, 0.0, 10.0),
            Param("base_share", 0.2, "share of requests to the base model", 0.0, 1.0),
            *_prefixed(1000, 100, 300, "one per served name"),
        ),
        builders.multi_lora,
    ),
    WorkloadInfo(
        "long-prefill",
        "long unique prompts, few output tokens: prefill-bound, load balancing only",
        (
            _tokens("prompt_tokens", 6000, "mean prompt tokens"),
            Param("spread", 0.5, "prompt lengths uniform in mean x [1-spread, 1+spread]", 0, 0.95),
            _tokens("output_tokens", 32, "output tokens per request"),
        ),
        builders.long_prefill,
    ),
    WorkloadInfo(
        "decode-heavy",
        "short unique prompts, long outputs: decode-bound, load balancing only",
        (
            _tokens("prompt_tokens", 200, "prompt tokens"),
            _tokens("output_tokens", 1000, "mean output tokens"),
            Param("spread", 0.5, "output lengths uniform in mean x [1-spread, 1+spread]", 0, 0.95),
        ),
        builders.decode_heavy,
    ),
    WorkloadInfo(
        "mixed-criticality",
        "Critical, Standard and Sheddable served names (adapters) under one load",
        (
            Param("critical_share", 0.2, "share of requests to `critical`", 0.0, 1.0),
            Param("sheddable_share", 0.4, "share to `sheddable`; `standard` gets the rest", 0, 1),
            _groups(32),
            *_prefixed(2000, 100, 300),
            Param(
                "objective_ms",
                0.0,
                "latency objective of `critical` (P95 of e2e / output "
                "tokens, in the EPP's pool file), ms; 0: none",
                0.0,
            ),
        ),
        builders.mixed_criticality,
    ),
    WorkloadInfo(
        "two-tenants",
        "tenants `heavy` and `light` (x-gateway-inference-fairness-id) of one Standard model, "
        "3:1 by default: flow control's fairness under saturation; a per-tenant table follows",
        (
            Param("heavy_share", 0.75, "share of requests from `heavy`; `light` the rest", 0, 1),
            _tokens("prompt_tokens", 3000, "prompt tokens (unique per request)"),
            _tokens("output_tokens", 200, "output tokens per request"),
        ),
        builders.two_tenants,
    ),
)
WORKLOADS: dict[str, WorkloadInfo] = {info.name: info for info in _INFOS}


def resolve_params(info: WorkloadInfo, params: Mapping[str, str] | None) -> dict[str, int | float]:
    """Defaults overridden by ``params`` (strings of ``--param key=value``), parsed, checked."""
    declared = {p.name: p for p in info.params}
    values: dict[str, int | float] = {p.name: p.default for p in info.params}
    for name, raw in (params or {}).items():
        param = declared.get(name)
        if param is None:
            known = ", ".join(declared)
            raise BenchError(f"workload {info.name} has no parameter {name!r}; it has: {known}")
        values[name] = param.parse(str(raw).strip())
    return values


def generate(
    name: str,
    *,
    rate: float,
    duration: float,
    seed: int,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    params: Mapping[str, str] | None = None,
    base_model: str = DEFAULT_BASE_MODEL,
) -> WorkloadPlan:
    """The plan of workload ``name``: its requests in send order, and what the fleet must serve.

    Raises ``BenchError`` for an unknown workload or parameter, or a value out of range.
    """
    info = WORKLOADS.get(name)
    if info is None:
        raise BenchError(f"unknown workload {name!r}; choose from: {', '.join(WORKLOADS)}")
    values = resolve_params(info, params)
    check_arrival(arrival, rate, duration, burstiness)
    arrival_rng = random.Random(f"{seed}:arrivals")

    def arrivals(at_rate: float, start: float, span: float) -> list[float]:
        return arrival_times(arrival, at_rate, span, arrival_rng, burstiness, start)

    content_rng = random.Random(f"{seed}:content")
    text = TextSource(content_rng)
    ctx = builders.Context(values, rate, duration, base_model, content_rng, text, arrivals)
    built = info.build(ctx)
    return WorkloadPlan(
        workload=name,
        params={**values, "arrival": arrival, "burstiness": burstiness, "seed": seed},
        requests=_in_send_order(built.requests),
        base_model=base_model,
        adapters=built.adapters,
        criticality=built.criticality,
        objectives=built.objectives,
    )


def _in_send_order(drafts: list[RequestSpec]) -> tuple[RequestSpec, ...]:
    """Sort by ``at`` (stable) and renumber ``index`` and ``follows`` to positions in the plan."""
    order = sorted(range(len(drafts)), key=lambda i: drafts[i].at)
    position = {old: new for new, old in enumerate(order)}
    out: list[RequestSpec] = []
    for new, old in enumerate(order):
        spec = drafts[old]
        follows = None if spec.follows is None else position[spec.follows]
        out.append(replace(spec, index=new, follows=follows))
    return tuple(out)
