"""The director: model lookup, traffic split, subset hints, shedding, rewrites."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter

import orjson
import pytest
from tests.support.pool import V1, model, pod, pool, pool_yaml

from endpoint_picker.datastore import Datastore
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.director import Director
from endpoint_picker.errors import (
    BadRequestError,
    ModelNotFoundError,
    PathNotFoundError,
    RequestError,
    ServiceUnavailableError,
    TooManyRequestsError,
)
from endpoint_picker.scheduling import build_scheduling
from endpoint_picker.settings import SchedulingSettings
from endpoint_picker.types import (
    EMPTY_METRICS,
    Criticality,
    Endpoint,
    EndpointState,
    MetricsSnapshot,
    SubsetHint,
)

NOW = 100.0


def make_director(
    *docs: dict[str, object],
    allow_unknown: bool | None = None,
    seed: int = 1,
    fallbacks: int = 0,
    queue: int = 0,
    extra_paths: tuple[str, ...] = (),
) -> tuple[Director, Datastore]:
    store = Datastore()
    store.apply(parse_pool_text(pool_yaml(*docs), "t"))
    for endpoint in store.endpoints:
        store.update_metrics(endpoint, MetricsSnapshot(waiting_queue_size=queue, updated_at=NOW))
    parts = build_scheduling(
        None,
        settings=SchedulingSettings(max_fallback_endpoints=fallbacks),
        staleness_threshold=2.0,
        clock=lambda: NOW,
        rng=random.Random(seed),
    )
    director = Director(
        store,
        parts.scheduler,
        parts.saturation_detector,
        allow_unknown_models=allow_unknown,
        extra_paths=extra_paths,
        rng=random.Random(seed),
    )
    return director, store


PODS = (pod("a", "127.0.0.2"), pod("b", "127.0.0.3"), pod("c", "127.0.0.4"))


def completion(model_name: str, **extra: object) -> bytes:
    return orjson.dumps({"model": model_name, "prompt": "hello", **extra})


def test_known_model_routes_with_its_criticality_and_body_untouched() -> None:
    """A served model routes; without a rewrite the exact bytes are forwarded."""
    director, _ = make_director(pool(), model("m", criticality="Critical"), *PODS)
    raw = b'{"model":  "m", "prompt": "hi"}'
    decision = director.route("r", "/v1/completions", raw, None)
    assert decision.body is raw
    assert decision.request.criticality is Criticality.CRITICAL
    assert decision.endpoints[0] in {"127.0.0.2:8000", "127.0.0.3:8000", "127.0.0.4:8000"}


@pytest.mark.parametrize(
    ("api", "allow", "outcome"),
    [
        ("alpha", None, "404"),
        ("alpha", True, Criticality.SHEDDABLE),
        ("v1", None, Criticality.STANDARD),
        ("v1", False, "404"),
    ],
)
def test_unknown_model_defaults(api: str, allow: bool | None, outcome: object) -> None:
    """v1alpha2 pools reject unknown models, v1 pools pass them; the flag overrides both."""
    the_pool = pool() if api == "alpha" else pool(api=V1)
    director, _ = make_director(the_pool, *PODS, allow_unknown=allow)
    if outcome == "404":
        with pytest.raises(ModelNotFoundError):
            director.route("r", "/v1/completions", completion("nope"), None)
    else:
        decision = director.route("r", "/v1/completions", completion("nope"), None)
        assert decision.request.criticality is outcome


def test_traffic_split_proportions_and_rewrite() -> None:
    """Targets are drawn by weight (zero never) and the body's model is rewritten."""
    director, _ = make_director(pool(), model("m", targets={"a": 3, "b": 1, "z": 0}), *PODS)
    counts: Counter[str] = Counter()
    for _ in range(4000):
        decision = director.route("r", "/v1/completions", completion("m", max_tokens=5), None)
        body = orjson.loads(decision.body)
        assert body["max_tokens"] == 5
        assert body["prompt"] == "hello"
        counts[body["model"]] += 1
    assert counts["z"] == 0
    assert 0.72 < counts["a"] / 4000 < 0.78


def test_all_zero_weights_is_503() -> None:
    """A split whose weights are all zero cannot route: 503."""
    director, _ = make_director(pool(), model("m", targets={"a": 0, "b": 0}), *PODS)
    with pytest.raises(ServiceUnavailableError, match="weight 0"):
        director.route("r", "/v1/completions", completion("m"), None)


@pytest.mark.parametrize(
    ("subset", "allowed"),
    [
        (["127.0.0.3:8000"], {"127.0.0.3:8000"}),
        (["127.0.0.4"], {"127.0.0.4:8000"}),
        (["127.0.0.9:8000", "127.0.0.2:8000", "junk"], {"127.0.0.2:8000"}),
    ],
)
def test_subset_hint_restricts_candidates(subset: list[str], allowed: set[str]) -> None:
    """Only endpoints in the subset hint (ip:port, or a bare ip for all its ports) are picked."""
    director, _ = make_director(pool(), model("m"), *PODS)
    for _ in range(20):
        assert (
            director.route("r", "/v1/completions", completion("m"), subset).endpoints[0] in allowed
        )


def test_a_parsed_subset_hint_selects_by_address_or_hostport_and_keeps_what_did_not_parse() -> None:
    """The hint parsed once: a bare address admits its every port, ``ip:port`` that port (IPv6
    canonical), the pool's order stays, and entries that are neither are kept aside."""
    hint = SubsetHint.parse(["127.0.0.4", "[0:0::1]:80", "127.0.0.2:8000", "junk", "10.0.0.1:0x1"])
    assert hint.malformed == ("junk", "10.0.0.1:0x1")
    states = [
        EndpointState(Endpoint(f"p{i}", "ns", address, port), EMPTY_METRICS)
        for i, (address, port) in enumerate(
            [("127.0.0.4", 9000), ("127.0.0.2", 8001), ("::1", 80), ("127.0.0.2", 8000),
             ("127.0.0.4", 8000), ("::1", 81)]
        )
    ]  # fmt: skip
    assert [s.endpoint.pod_name for s in hint.select(states)] == ["p0", "p2", "p3", "p4"]


@pytest.mark.parametrize("subset", [[], ["127.0.0.9:8000"], ["127.0.0.2:9999"]])
def test_empty_or_ineligible_subset_is_503(subset: list[str]) -> None:
    """An empty subset or one with no eligible endpoint: 503."""
    director, _ = make_director(pool(), model("m"), *PODS)
    with pytest.raises(ServiceUnavailableError):
        director.route("r", "/v1/completions", completion("m"), subset)


def test_no_ready_endpoint_is_503() -> None:
    """A pool without Ready pods: 503."""
    director, _ = make_director(pool(), model("m"), pod("a", "127.0.0.2", ready=False))
    with pytest.raises(ServiceUnavailableError, match="no ready endpoint"):
        director.route("r", "/v1/completions", completion("m"), None)


def test_error_order_parse_before_model_before_endpoints() -> None:
    """The first failing step decides: a bad body is 400 even for an unknown model, no pods."""
    director, _ = make_director(pool())
    with pytest.raises(BadRequestError):
        director.route("r", "/v1/completions", b'{"model": "nope"}', None)
    with pytest.raises(ModelNotFoundError):
        director.route("r", "/v1/completions", completion("nope"), None)


def test_sheddable_shed_when_saturated_critical_not() -> None:
    """A saturated pool sheds sheddable requests with 429 and still routes critical ones."""
    director, _ = make_director(
        pool(),
        model("s", criticality="Sheddable"),
        model("c", criticality="Critical"),
        *PODS,
        queue=50,
    )
    with pytest.raises(TooManyRequestsError):
        director.route("r", "/v1/completions", completion("s"), None)
    assert director.route("r", "/v1/completions", completion("c"), None).endpoints


def test_fallbacks_are_distinct_primary_first() -> None:
    """With fallbacks the destination lists distinct endpoints."""
    director, _ = make_director(pool(), model("m"), *PODS, fallbacks=2)
    decision = director.route("r", "/v1/completions", completion("m"), None)
    assert len(set(decision.endpoints)) == 3
    assert decision.destination == ",".join(decision.endpoints)


def test_pods_sharing_an_address_get_one_share_and_one_fallback_entry() -> None:
    """Two pods on one address are one endpoint: never listed twice, no double share."""
    shared = (pod("a", "127.0.0.2"), pod("a-again", "127.0.0.2"), pod("b", "127.0.0.3"))
    director, _ = make_director(pool(), model("m"), *shared, fallbacks=2)
    picks: Counter[str] = Counter()
    for i in range(200):
        decision = director.route(f"r{i}", "/v1/completions", completion("m"), None)
        assert sorted(decision.endpoints) == ["127.0.0.2:8000", "127.0.0.3:8000"]
        picks[decision.endpoints[0]] += 1
    assert abs(picks["127.0.0.2:8000"] - picks["127.0.0.3:8000"]) < 60, picks


def test_models_list_comes_from_the_pool_or_from_a_server() -> None:
    """GET /v1/models lists the InferenceModels; a pool without any lets a server answer."""
    director, _ = make_director(pool(), model("b"), model("a", targets={"a-v1": 1}), *PODS)
    assert director.list_models() == ["a", "b"]
    bare, _ = make_director(pool(api=V1), *PODS)
    assert bare.list_models() is None
    assert bare.route_headers_only("r", "/v1/models", None).endpoints


@pytest.mark.parametrize(
    "path",
    ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/metrics", "/healthz", "/v1/x"],
)
def test_admin_and_unknown_paths_are_404(path: str) -> None:
    """A model server's admin API is never routed: a 404, with or without a body."""
    director, _ = make_director(pool(), model("m"), *PODS)
    with pytest.raises(PathNotFoundError, match="not an inference API"):
        director.route("r", path, completion("m"), None)
    with pytest.raises(PathNotFoundError):
        director.route_headers_only("r", path, None)


def test_health_is_never_routed_to_a_pod() -> None:
    """/health is the gateway's own (the stream answers it): the director routes it nowhere."""
    director, _ = make_director(pool(), model("m"), *PODS, extra_paths=("/health",))
    with pytest.raises(RequestError):
        director.route("r", "/health", completion("m"), None)
    with pytest.raises(RequestError):
        director.route_headers_only("r", "/health", None)
    assert director.has_ready_endpoint()
    unready, _ = make_director(pool(), model("m"), pod("a", "127.0.0.2", ready=False))
    assert not unready.has_ready_endpoint()


def test_extra_paths_are_routed() -> None:
    """--extra-inference-path opens a path: it routes with just a model."""
    director, _ = make_director(pool(), model("m"), *PODS, extra_paths=("/v1/rerank/",))
    assert director.route("r", "/v1/rerank", orjson.dumps({"model": "m"}), None).endpoints


def test_unreachable_endpoints_get_no_requests_until_scraped_again() -> None:
    """An endpoint marked unreachable is skipped; a successful scrape brings it back."""
    director, store = make_director(pool(), model("m"), *PODS)
    store.mark_unreachable("127.0.0.2:8000", "test")
    store.mark_unreachable("127.0.0.3:8000", "test")
    picks = {director.route("r", "/v1/completions", completion("m"), None).endpoints[0]}
    picks |= {director.route("r", "/v1/completions", completion("m"), None).endpoints[0]}
    assert picks == {"127.0.0.4:8000"}
    endpoint = next(e for e in store.endpoints if e.hostport == "127.0.0.2:8000")
    store.update_metrics(endpoint, MetricsSnapshot(updated_at=NOW))
    assert {s.hostport for s in store.endpoint_states()} == {
        "127.0.0.2:8000",
        "127.0.0.4:8000",
    }


def test_when_every_endpoint_is_unreachable_all_stay_candidates() -> None:
    """No endpoint reachable: route as without the signal, never refuse on it alone."""
    director, store = make_director(pool(), model("m"), *PODS)
    for endpoint in store.endpoints:
        store.mark_unreachable(endpoint.hostport, "test")
    assert len(store.endpoint_states()) == 3
    assert director.route("r", "/v1/completions", completion("m"), None).endpoints


def test_a_huge_model_name_is_clipped_in_the_error() -> None:
    """A 7 MB model name comes back cut to a few hundred characters, marked as cut."""
    director, _ = make_director(pool(), model("m"), *PODS)
    with pytest.raises(ModelNotFoundError) as caught:
        director.route("r", "/v1/completions", completion("x" * 7_000_000), None)
    assert len(caught.value.message) < 400
    assert "[cut: 7000000 characters in all]" in caught.value.message


def test_rewrite_keeps_every_other_value_exactly() -> None:
    """A split rewrites only the model: huge integers, floats and unicode survive unchanged."""
    director, _ = make_director(pool(), model("m", targets={"a": 1}), *PODS)
    raw = (
        b'{"model": "m", "prompt": "caf\\u00e9 \xc3\xa9", '
        b'"seed": 123456789012345678901234567890, "temperature": 0.1}'
    )
    decision = director.route("r", "/v1/completions", raw, None)
    assert b'"seed": 123456789012345678901234567890' in decision.body
    assert json.loads(decision.body) == {**json.loads(raw), "model": "a"}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"tools": [{"model": "m"}], "model" : "m", "prompt": "x"}',  # a nested key first
        b'{"prompt": "say \\"model\\": \\"m\\"", "model":"m"}',  # the key inside a string
        b'{\n  "model": "m",\n  "prompt": "x",\n  "n": 1.50\n}',  # formatting kept
    ],
)
def test_rewrite_touches_only_the_top_level_model(raw: bytes) -> None:
    """Only the top-level model value changes; every other byte of the body stays."""
    director, _ = make_director(pool(), model("m", targets={"a": 1}), *PODS)
    decision = director.route("r", "/v1/completions", raw, None)
    assert json.loads(decision.body) == {**json.loads(raw), "model": "a"}
    assert len(decision.body) == len(raw) - len('"m"') + len('"a"')


def test_rewrite_handles_the_deepest_body_the_parser_accepts() -> None:
    """A split model with a prompt nested 1,020 levels deep is rewritten, not a 500."""
    director, _ = make_director(pool(), model("m", targets={"a": 1}), *PODS)
    depth = 1020  # orjson accepts 1,024 levels; Python's own recursion limit is about 1,000
    raw = (
        b'{"tools": [{"model": "m"}], "prompt": ' + b"[" * depth + b"]" * depth + b', "model": "m"}'
    )
    decision = director.route("r", "/v1/completions", raw, None)
    assert orjson.loads(decision.body)["model"] == "a"
    assert decision.body == raw[: -len(b'"m"}')] + b'"a"}'  # only the top-level value changed


def test_rewrite_of_a_deep_body_with_an_escaped_model_key_is_a_400_or_a_rewrite() -> None:
    """A body only the fallback can rewrite, nested past Python 3.11's recursion limit, is a
    clean 400 there; Python 3.12's json goes deeper and rewrites it. Never a crash."""
    director, _ = make_director(pool(), model("m", targets={"a": 1}), *PODS)
    depth = 1020
    raw = b'{"\\u006dodel": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    if sys.version_info < (3, 12):
        with pytest.raises(BadRequestError, match="nested too deeply"):
            director.route("r", "/v1/completions", raw, None)
    else:
        decision = director.route("r", "/v1/completions", raw, None)
        assert orjson.loads(decision.body)["model"] == "a"
