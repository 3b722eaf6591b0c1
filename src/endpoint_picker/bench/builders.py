"""The request streams behind each workload, from resolved parameters to unordered requests.

A builder returns ``RequestSpec``s whose ``index`` (and ``follows``) are positions in its own
list; ``workloads.generate`` sorts them by ``at`` and renumbers. Parameters arrive parsed and
range-checked (``workloads.WORKLOADS`` declares them); builders check only what spans several.
The chat builder is in ``sessions``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from endpoint_picker.bench.model import FAIRNESS_HEADER, BenchError, RequestSpec
from endpoint_picker.bench.prompts import TextSource, completion_body

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Context:
    """What a builder works from: parameters, a seeded content source and the arrival process.

    ``arrivals(rate, start, duration)`` draws arrival times from the run's process (its kind and
    burstiness fixed) and its own seeded stream, so content choices never shift timing.
    """

    values: Mapping[str, float]
    rate: float
    duration: float
    base_model: str
    rng: random.Random
    text: TextSource
    arrivals: Callable[[float, float, float], list[float]]

    def integer(self, name: str) -> int:
        return int(self.values[name])


@dataclass(frozen=True, slots=True)
class Built:
    requests: list[RequestSpec]
    adapters: tuple[str, ...] = ()
    criticality: dict[str, str] = field(default_factory=dict)
    objectives: dict[str, float] = field(default_factory=dict)  # served name -> seconds


@dataclass(frozen=True, slots=True)
class _Group:
    label: str
    model: str
    system: str  # built once; every request of the group reuses this very string


def zipf_weights(n: int, skew: float) -> list[float]:
    """Popularity of ranks 0..n-1 under Zipf exponent ``skew`` (0: uniform), rank 0 the hottest."""
    return [1.0 / (rank + 1) ** skew for rank in range(n)]


def _system_prompts(ctx: Context, count: int, tokens: int) -> list[str]:
    return [ctx.text.text(f"System prompt {g} ({ctx.text.tag()}). ", tokens) for g in range(count)]


def _grouped(ctx: Context, groups: Sequence[_Group], weights: Sequence[float]) -> list[RequestSpec]:
    """Arrivals at the run's rate, each a random group's system prompt plus its own question."""
    times = ctx.arrivals(ctx.rate, 0.0, ctx.duration)
    picks = ctx.rng.choices(range(len(groups)), cum_weights=list(accumulate(weights)), k=len(times))
    question_tokens = ctx.integer("question_tokens")
    output_tokens = ctx.integer("output_tokens")
    text = ctx.text.text
    out: list[RequestSpec] = []
    for i, (at, g) in enumerate(zip(times, picks, strict=True)):
        group = groups[g]
        prompt = group.system + text(f"\nQuestion {i}: ", question_tokens)
        body = completion_body(group.model, prompt, output_tokens)
        out.append(RequestSpec(i, at, COMPLETIONS, body, group=group.label,
                               expected_output_tokens=output_tokens))  # fmt: skip
    return out


def shared_prefix(ctx: Context) -> Built:
    count = ctx.integer("groups")
    systems = _system_prompts(ctx, count, ctx.integer("prompt_tokens"))
    groups = [_Group(f"group-{g}", ctx.base_model, s) for g, s in enumerate(systems)]
    return Built(_grouped(ctx, groups, zipf_weights(count, ctx.values["skew"])))


def hot_prefix(ctx: Context) -> Built:
    count = ctx.integer("groups")
    hot = ctx.values["hot_share"]
    systems = _system_prompts(ctx, count, ctx.integer("prompt_tokens"))
    groups = [_Group(f"group-{g}", ctx.base_model, s) for g, s in enumerate(systems)]
    weights = [hot] + [(1.0 - hot) / (count - 1)] * (count - 1)
    return Built(_grouped(ctx, groups, weights))


def multi_lora(ctx: Context) -> Built:
    count = ctx.integer("adapters")
    base_share = ctx.values["base_share"]
    adapters = tuple(f"adapter-{a}" for a in range(count))
    # One system prompt per served name: the adapter's application. (The simulator, like vLLM,
    # seeds the prefix hashes with the adapter, so names never share KV blocks anyway.)
    systems = _system_prompts(ctx, count + 1, ctx.integer("prompt_tokens"))
    names = (*adapters, ctx.base_model)
    groups = [_Group(name, name, s) for name, s in zip(names, systems, strict=True)]
    zipf = zipf_weights(count, ctx.values["skew"])
    total = sum(zipf)
    weights = [(1.0 - base_share) * w / total for w in zipf] + [base_share]
    return Built(_grouped(ctx, groups, weights), adapters=adapters)


CRITICALITIES = (("critical", "Critical"), ("standard", "Standard"), ("sheddable", "Sheddable"))


def mixed_criticality(ctx: Context) -> Built:
    critical, sheddable = ctx.values["critical_share"], ctx.values["sheddable_share"]
    if critical + sheddable > 1.0 + 1e-9:
        raise BenchError(
            f"critical_share + sheddable_share must be at most 1 (standard gets the rest), "
            f"got {critical} + {sheddable}"
        )
    shares = (critical, max(0.0, 1.0 - critical - sheddable), sheddable)
    count = ctx.integer("groups")
    systems = _system_prompts(ctx, count, ctx.integer("prompt_tokens"))
    groups: list[_Group] = []
    weights: list[float] = []
    # The same applications are used at every criticality (a shared product behind three
    # service tiers); each served name still caches apart, as each is its own adapter.
    for (name, _), share in zip(CRITICALITIES, shares, strict=True):
        groups += [_Group(f"{name}/group-{g}", name, s) for g, s in enumerate(systems)]
        weights += [share / count] * count
    objective_ms = ctx.values["objective_ms"]
    return Built(
        _grouped(ctx, groups, weights),
        adapters=tuple(name for name, _ in CRITICALITIES),
        criticality=dict(CRITICALITIES),
        objectives={"critical": objective_ms / 1000} if objective_ms else {},
    )


TENANTS = ("heavy", "light")


def two_tenants(ctx: Context) -> Built:
    """One Standard model; each request from ``heavy`` (``heavy_share``) or ``light``, named by
    the fairness header and ``group``. Prompts are unique (no prefix shared), so caching and
    affinity take no part: only flow control's fairness decides who is served."""
    heavy_share = ctx.values["heavy_share"]
    prompt_tokens, output_tokens = ctx.integer("prompt_tokens"), ctx.integer("output_tokens")
    out: list[RequestSpec] = []
    for i, at in enumerate(ctx.arrivals(ctx.rate, 0.0, ctx.duration)):
        tenant = TENANTS[0] if ctx.rng.random() < heavy_share else TENANTS[1]
        prompt = ctx.text.text(f"Tenant {tenant} request {i} ({ctx.text.tag()}): ", prompt_tokens)
        body = completion_body(ctx.base_model, prompt, output_tokens)
        out.append(RequestSpec(i, at, COMPLETIONS, body, {FAIRNESS_HEADER: tenant}, group=tenant,
                               expected_output_tokens=output_tokens))  # fmt: skip
    return Built(out, criticality={ctx.base_model: "Standard"})


def _spread(rng: random.Random, mean: int, spread: float) -> int:
    """A length uniform in ``mean * [1 - spread, 1 + spread]``, at least 1."""
    return max(1, round(mean * (1.0 + spread * (2.0 * rng.random() - 1.0))))


def _unique(ctx: Context, spread_prompt: float, spread_output: float) -> list[RequestSpec]:
    """Requests that share no prefix: routing can only balance load (lengths vary)."""
    times = ctx.arrivals(ctx.rate, 0.0, ctx.duration)
    prompt_tokens, output_tokens = ctx.integer("prompt_tokens"), ctx.integer("output_tokens")
    out: list[RequestSpec] = []
    for i, at in enumerate(times):
        p = _spread(ctx.rng, prompt_tokens, spread_prompt)
        o = _spread(ctx.rng, output_tokens, spread_output)
        prompt = ctx.text.text(f"Document {i} ({ctx.text.tag()}): ", p)
        body = completion_body(ctx.base_model, prompt, o)
        out.append(RequestSpec(i, at, COMPLETIONS, body, expected_output_tokens=o))
    return out


def long_prefill(ctx: Context) -> Built:
    return Built(_unique(ctx, ctx.values["spread"], 0.0))


def decode_heavy(ctx: Context) -> Built:
    return Built(_unique(ctx, 0.0, ctx.values["spread"]))
