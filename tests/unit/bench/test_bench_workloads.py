"""Workload plans: seeded, ordered, grouped as declared, skewed as asked, bad input refused."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from endpoint_picker.bench.model import FAIRNESS_HEADER, BenchError, WorkloadPlan
from endpoint_picker.bench.workloads import WORKLOADS, Param, generate

# Small prompts keep every plan cheap; the structure does not depend on the sizes.
_SMALL: dict[str, dict[str, str]] = {
    "shared-prefix": {"prompt_tokens": "64", "groups": "12"},
    "hot-prefix": {"prompt_tokens": "64", "groups": "12"},
    "chat": {"system_tokens": "32", "user_tokens": "8", "output_tokens": "10"},
    "multi-lora": {"prompt_tokens": "32"},
    "long-prefill": {"prompt_tokens": "64"},
    "decode-heavy": {"output_tokens": "100"},
    "mixed-criticality": {"prompt_tokens": "32"},
    "two-tenants": {"prompt_tokens": "32", "output_tokens": "10"},
}


def _plan(name: str, seed: int = 1, rate: float = 20.0, duration: float = 30.0,
          **params: str) -> WorkloadPlan:  # fmt: skip
    return generate(name, rate=rate, duration=duration, seed=seed,
                    params={**_SMALL[name], **params})  # fmt: skip


def test_every_workload_is_listed_with_parseable_defaults() -> None:
    """The listing covers the issue's workloads; every default parses back as its own type."""
    assert set(WORKLOADS) == set(_SMALL)
    for name, info in WORKLOADS.items():
        assert info.name == name
        assert info.description
        assert info.params
        for p in info.params:
            assert p.help
            assert p.parse(str(p.default)) == p.default
            assert type(p.parse(str(p.default))) is type(p.default)


@pytest.mark.parametrize("name", sorted(_SMALL))
def test_same_seed_same_plan_other_seed_other_plan(name: str) -> None:
    """A seed fixes requests, text and timing; another seed changes both text and times."""
    a, b, c = _plan(name), _plan(name), _plan(name, seed=2)
    assert a == b
    assert [r.at for r in a.requests] != [r.at for r in c.requests]
    assert [r.body for r in a.requests[:5]] != [r.body for r in c.requests[:5]]


@pytest.mark.parametrize("name", sorted(_SMALL))
def test_plan_is_in_send_order_at_the_rate(name: str) -> None:
    """Requests are numbered in send order within [0, duration), about rate x duration of them,
    each a streaming body with usage, ignore_eos and its expected output length."""
    plan = _plan(name, rate=40.0, duration=60.0)
    assert [r.index for r in plan.requests] == list(range(len(plan.requests)))
    ats = [r.at for r in plan.requests]
    assert ats == sorted(ats)
    assert ats[0] >= 0.0
    assert ats[-1] < 60.0
    assert len(plan.requests) == pytest.approx(2400, rel=0.1)
    served = {plan.base_model, *plan.adapters}
    for r in plan.requests:
        body = r.body
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True
        assert body["model"] in served
        assert body["max_tokens"] == r.expected_output_tokens > 0


def test_groups_share_the_exact_prefix_and_differ_from_the_first_block() -> None:
    """Within a group the system prompt is byte-identical (one string); groups differ in their
    first 64 characters (the first KV block); questions are unique; lengths are exact."""
    plan = _plan("shared-prefix", groups="12", prompt_tokens="64", question_tokens="5")
    system: dict[str, str] = {}
    for r in plan.requests:
        prompt = r.body["prompt"]
        assert len(prompt) == 4 * (64 + 5)
        assert r.path == "/v1/completions"
        system.setdefault(r.group, prompt[: 4 * 64])
        assert prompt[: 4 * 64] == system[r.group]
    assert len(system) == 12
    assert len({s[:64] for s in system.values()}) == 12
    assert len({r.body["prompt"][4 * 64 :] for r in plan.requests}) == len(plan.requests)


def test_hot_prefix_carries_half_the_traffic() -> None:
    """One group gets hot_share of the requests; the rest spread over every other group."""
    plan = _plan("hot-prefix", rate=100.0, duration=40.0)
    counts = Counter(r.group for r in plan.requests)
    assert counts["group-0"] / len(plan.requests) == pytest.approx(0.5, abs=0.03)
    others = [n for g, n in counts.items() if g != "group-0"]
    assert len(others) == 11
    assert max(others) < counts["group-0"] / 5


def test_zipf_skew_orders_popularity() -> None:
    """With skew s group k gets ~1/(k+1)^s of group 0's traffic; skew 0 is uniform."""
    skewed = Counter(r.group for r in _plan("shared-prefix", rate=100.0, duration=40.0,
                                            skew="1.2").requests)  # fmt: skip
    top = [skewed[f"group-{k}"] for k in range(4)]
    assert top == sorted(top, reverse=True)
    assert top[1] / top[0] == pytest.approx(2**-1.2, rel=0.15)
    flat = Counter(r.group for r in _plan("shared-prefix", rate=100.0, duration=40.0).requests)
    assert max(flat.values()) < 1.4 * min(flat.values())


def test_multi_lora_spreads_over_adapters_and_base() -> None:
    """Adapters adapter-0..N-1 are served; the base gets base_share; adapter-0 is the hottest."""
    plan = _plan("multi-lora", rate=100.0, duration=40.0, adapters="4", base_share="0.3")
    assert plan.adapters == ("adapter-0", "adapter-1", "adapter-2", "adapter-3")
    models = Counter(r.body["model"] for r in plan.requests)
    assert models[plan.base_model] / len(plan.requests) == pytest.approx(0.3, abs=0.03)
    assert models.most_common(2)[0][0] in ("adapter-0", plan.base_model)
    assert models["adapter-0"] > models["adapter-1"] > models["adapter-3"]


def test_mixed_criticality_serves_three_tiers() -> None:
    """critical/standard/sheddable are adapters mapped to their criticality, at the given shares."""
    plan = _plan("mixed-criticality", rate=100.0, duration=40.0, critical_share="0.1",
                 sheddable_share="0.5")  # fmt: skip
    assert plan.criticality == {"critical": "Critical", "standard": "Standard",
                                "sheddable": "Sheddable"}  # fmt: skip
    assert set(plan.adapters) == set(plan.criticality)
    models = Counter(r.body["model"] for r in plan.requests)
    n = len(plan.requests)
    assert models["critical"] / n == pytest.approx(0.1, abs=0.03)
    assert models["sheddable"] / n == pytest.approx(0.5, abs=0.03)
    assert models["standard"] / n == pytest.approx(0.4, abs=0.03)


def test_two_tenants_name_themselves_in_the_fairness_header() -> None:
    """Every request carries heavy or light in the fairness header (and as its group), heavy
    at heavy_share; one Standard model, no adapters; no two prompts share a first block."""
    plan = _plan("two-tenants", rate=100.0, duration=40.0)
    tenants = Counter(r.headers[FAIRNESS_HEADER] for r in plan.requests)
    assert set(tenants) == {"heavy", "light"}
    assert tenants["heavy"] / len(plan.requests) == pytest.approx(0.75, abs=0.03)
    assert all(r.group == r.headers[FAIRNESS_HEADER] for r in plan.requests)
    assert {r.body["model"] for r in plan.requests} == {plan.base_model}
    assert plan.adapters == ()
    assert plan.criticality == {plan.base_model: "Standard"}
    assert {r.body["max_tokens"] for r in plan.requests} == {10}
    assert {len(r.body["prompt"]) for r in plan.requests} == {4 * 32}
    assert len({r.body["prompt"][:64] for r in plan.requests}) == len(plan.requests)


def test_two_tenants_share_moves_no_arrival() -> None:
    """heavy_share changes who sends, never when: the arrivals stay those of the seed; the
    extremes give one tenant everything."""
    plan = _plan("two-tenants", rate=50.0, duration=20.0)
    even = _plan("two-tenants", rate=50.0, duration=20.0, heavy_share="0.5")
    assert [r.at for r in even.requests] == [r.at for r in plan.requests]
    shares = Counter(r.headers[FAIRNESS_HEADER] for r in even.requests)
    assert shares["heavy"] / len(even.requests) == pytest.approx(0.5, abs=0.06)
    for share, only in (("1", "heavy"), ("0", "light")):
        one = _plan("two-tenants", rate=50.0, duration=20.0, heavy_share=share)
        assert {r.headers[FAIRNESS_HEADER] for r in one.requests} == {only}


def test_unique_workloads_vary_the_long_side() -> None:
    """long-prefill varies prompt lengths, decode-heavy output lengths, within the spread;
    no two prompts share a first block."""
    prefill = _plan("long-prefill", spread="0.5").requests
    lengths = {len(r.body["prompt"]) // 4 for r in prefill}
    assert min(lengths) >= 32
    assert max(lengths) <= 96
    assert len(lengths) > 20
    assert len({r.body["prompt"][:64] for r in prefill}) == len(prefill)
    assert {r.body["max_tokens"] for r in prefill} == {32}
    outputs = {r.body["max_tokens"] for r in _plan("decode-heavy", spread="0.2").requests}
    assert min(outputs) >= 80
    assert max(outputs) <= 120
    assert len(outputs) > 20


def test_plan_records_its_parameters() -> None:
    """The plan keeps every resolved parameter, overrides parsed, plus the arrival and seed."""
    plan = generate("hot-prefix", rate=5.0, duration=2.0, seed=9, arrival="bursty",
                    burstiness=0.5, params={"hot_share": "0.7", "prompt_tokens": "16"})  # fmt: skip
    assert plan.params["hot_share"] == 0.7
    assert plan.params["groups"] == 200
    assert plan.params["prompt_tokens"] == 16
    assert (plan.params["arrival"], plan.params["burstiness"], plan.params["seed"]) == (
        "bursty", 0.5, 9)  # fmt: skip


def test_generation_is_fast() -> None:
    """60 s at 50 requests/s with 2,000-token prefixes generates in well under half a second of
    CPU (about 0.06 s here; CPU time, so a busy machine does not fail it)."""
    start = time.process_time()
    plan = generate("shared-prefix", rate=50.0, duration=60.0, seed=1,
                    params={"prompt_tokens": "2000", "groups": "16"})  # fmt: skip
    assert time.process_time() - start < 0.5
    assert len(plan.requests) > 2500


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("nope", {}, "unknown workload 'nope'; choose from: shared-prefix"),
        ("shared-prefix", {"colour": "red"}, "has no parameter 'colour'; it has: groups"),
        ("shared-prefix", {"groups": "many"}, "groups=many: expected an integer"),
        ("shared-prefix", {"groups": "2.5"}, "groups=2.5: expected an integer"),
        ("shared-prefix", {"groups": "0"}, "groups=0: must be at least 1"),
        ("shared-prefix", {"skew": "-1"}, "skew=-1: must be at least 0"),
        ("shared-prefix", {"skew": "inf"}, "skew=inf: must be a finite number"),
        ("chat", {"think_time": "nan"}, "think_time=nan: must be a finite number"),
        ("multi-lora", {"skew": "11"}, "skew=11: must be at most 10"),
        ("hot-prefix", {"groups": "1"}, "groups=1: must be at least 2"),
        ("hot-prefix", {"hot_share": "1.5"}, "hot_share=1.5: must be at most 1"),
        ("two-tenants", {"heavy_share": "1.5"}, "heavy_share=1.5: must be at most 1"),
        ("chat", {"think_time": "soon"}, "think_time=soon: expected a number"),
        ("mixed-criticality", {"critical_share": "0.7", "sheddable_share": "0.5"},
         "critical_share \\+ sheddable_share must be at most 1"),
    ],
)  # fmt: skip
def test_bad_parameters_are_bench_errors(name: str, params: dict[str, str], message: str) -> None:
    """An unknown workload or parameter, an unparseable or out-of-range value: a clear error."""
    with pytest.raises(BenchError, match=message):
        generate(name, rate=1.0, duration=1.0, seed=1, params=params)


def test_bad_arrival_is_a_bench_error() -> None:
    """The arrival process is checked before any request is built."""
    with pytest.raises(BenchError, match="burstiness applies to --arrival bursty only"):
        generate("chat", rate=1.0, duration=1.0, seed=1, burstiness=0.5)


def test_param_bounds_are_inclusive() -> None:
    """A value equal to a bound is accepted."""
    p = Param("x", 0.5, "x", 0.0, 1.0)
    assert (p.parse("0"), p.parse("1")) == (0.0, 1.0)
