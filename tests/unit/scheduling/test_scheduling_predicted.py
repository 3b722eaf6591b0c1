"""predicted-latency-scorer and predicted-latency-detector: a pick decided by predicted seconds
(a cached prefix behind a queue against an idle server without it), objectives from headers,
and a band held only when no endpoint is predicted within its objective."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import pytest
from tests.unit.scheduling.builders import HEADER, build, clock, endpoint

from endpoint_picker.exchange import Lifecycle
from endpoint_picker.requests import Api, LLMRequest
from endpoint_picker.scheduling.adapters import AdapterFlights
from endpoint_picker.scheduling.lifecycle import REQUESTS_REMEMBERED, InFlight
from endpoint_picker.scheduling.plugins import PredictedLatencyDetector, PredictedLatencyScorer
from endpoint_picker.scheduling.prediction import (
    MAX_PRIORITIES,
    OBJECTIVE_WINDOW,
    PredictionSource,
    header_objectives,
)
from endpoint_picker.scheduling.predictor import LatencyPredictor
from endpoint_picker.scheduling.prefix import CHARS_PER_TOKEN
from endpoint_picker.types import Criticality, EndpointState

_ids = itertools.count()
PROMPT = "".join(f"system prompt sentence {i}. " for i in range(700))  # ~4,000 tokens
# TTFT laws: seconds per (1, uncached ktok, ahead ktok, waiting/10, running/10, kv, adapter load,
# adapter wait)
PREFILL_BOUND = (
    0.01,
    0.05,
    0.05,
    0.02,
    0.002,
    0.0,
    0.03,
    0.5,
)  # a prefill costs more than a short queue
QUEUE_BOUND = (0.01, 0.005, 0.005, 1.0, 0.002, 0.0, 0.03, 0.5)  # each waiting request costs 100 ms


def completion(headers: dict[str, str] | None = None) -> LLMRequest:
    return LLMRequest(
        request_id=f"q{next(_ids)}",
        api=Api.COMPLETIONS,
        model="m",
        raw_body=b"{}",
        body={"prompt": PROMPT + f"question {next(_ids)}?"},
        target_model="m",
        stream=True,
        headers=headers or {},
    )


def source_with(law: Sequence[float], endpoints: Sequence[EndpointState]) -> PredictionSource:
    """A source whose endpoints all follow ``law`` (set, not learned: the predictor's own
    tests cover learning)."""
    source = PredictionSource(LatencyPredictor(clock), InFlight(clock))
    for e in endpoints:
        source.predictor.model(e.hostport).ttft.theta = list(law)
    return source


def cache_prompt_on(source: PredictionSource, e: EndpointState) -> None:
    """``e`` has served a request with the same prompt prefix (not streamed: no sample)."""
    lifecycle = Lifecycle([source], [source], [source])
    first = replace(completion(), stream=False)
    source.features(first, [e])
    lifecycle.routed(first, e.hostport)
    lifecycle.started(first.request_id)
    lifecycle.finished(first.request_id, True)


@pytest.mark.parametrize(
    ("law", "winner"),
    [(PREFILL_BOUND, "cached"), (QUEUE_BOUND, "idle")],
    ids=["prefill-costs-more", "queue-costs-more"],
)
def test_cached_prefix_behind_a_queue_against_an_idle_server_is_decided_by_seconds(
    law: Sequence[float], winner: str
) -> None:
    """The endpoint holding the prompt's prefix with 3 requests waiting wins when a prefill
    costs more than that wait, and the idle endpoint without it wins when the wait costs more."""
    cached, idle = endpoint(queue=3), endpoint()
    source = source_with(law, [cached, idle])
    cache_prompt_on(source, cached)
    scores = PredictedLatencyScorer(source).score(completion(), [cached, idle])
    best = "cached" if scores[0] > scores[1] else "idle"
    assert best == winner
    assert max(scores) == 1.0


def test_a_queue_that_built_before_the_fit_saw_it_costs_its_head_of_line_wait() -> None:
    """Requests routed to the prefix's holder that have not started for 3 s make it lose to an
    idle endpoint, though the fitted model (which learns of a queue only as it drains) still
    prices the wait below the prefill; with ``headOfLineWait`` off the holder still wins."""
    now = [1000.0]
    cached, idle = endpoint(), endpoint()
    for head_wait, winner in ((True, "idle"), (False, "cached")):
        source = PredictionSource(LatencyPredictor(lambda: now[0]), InFlight(lambda: now[0]))
        for e in (cached, idle):
            source.predictor.model(e.hostport).ttft.theta = list(PREFILL_BOUND)
        cache_prompt_on(source, cached)
        scorer = PredictedLatencyScorer(source, head_wait=head_wait)
        lifecycle = Lifecycle([source], [source], [source])
        for _ in range(3):  # queued at the holder, not started
            queued = completion()
            scorer.score(queued, [cached])
            lifecycle.routed(queued, cached.hostport)
        now[0] += 3.0
        scores = scorer.score(completion(), [cached, idle])
        assert ("cached" if scores[0] > scores[1] else "idle") == winner


def test_decode_weight_weighs_the_whole_decode_a_request_joins() -> None:
    """With ``decodeWeight`` the cost counts TPOT x a typical response's tokens (learned from
    finished requests): a cached prefix on a server decoding at half speed loses to a fast
    server without it; with the weight at 0 (the default) the TTFT-first cost keeps it."""
    slow, fast = endpoint(), endpoint()
    for weight, winner in ((1.0, "fast"), (0.0, "slow")):
        source = source_with(PREFILL_BOUND, [slow, fast])
        source.predictor.model(slow.hostport).tpot.theta = [0.04, 0.0, 0.0, 0.0]
        source.predictor.model(fast.hostport).tpot.theta = [0.02, 0.0, 0.0, 0.0]
        cache_prompt_on(source, slow)
        lifecycle = Lifecycle([source], [source], [source])
        for _ in range(300):  # finished requests of 100 output tokens teach the typical output
            done = completion()
            lifecycle.routed(done, fast.hostport)
            lifecycle.finished(done.request_id, True, None, 100)
        assert source.typical_output == pytest.approx(100, rel=0.01)
        scores = PredictedLatencyScorer(source, decode_weight=weight).score(
            completion(), [slow, fast]
        )
        assert ("slow" if scores[0] > scores[1] else "fast") == winner


def test_uncached_tokens_come_from_the_prefix_index() -> None:
    """The request's uncached prompt is nearly all of it where nothing is cached and only its
    question where the prefix is."""
    cached, cold = endpoint(), endpoint()
    source = source_with(PREFILL_BOUND, [cached, cold])
    cache_prompt_on(source, cached)
    request = completion()
    (warm_x, _), (cold_x, _) = source.features(request, [cached, cold])
    prompt_ktok = len(request.body["prompt"]) / CHARS_PER_TOKEN / 1000
    assert cold_x[1] == pytest.approx(prompt_ktok)
    assert warm_x[1] < 0.1 * prompt_ktok


@pytest.mark.parametrize(
    ("ttft", "tpot", "expected"),
    [
        ("500", None, (0.5, None)),
        (None, "20", (None, 0.02)),
        ("3600000", "1", (3600.0, 0.001)),
        ("3600001", None, (None, None)),  # past an hour
        ("0", None, (None, None)),
        ("-5", None, (None, None)),
        (" 5", None, (None, None)),
        ("1e3", None, (None, None)),
        ("٣", None, (None, None)),  # another script's digit
        ("9" * 40, None, (None, None)),
        ("", "", (None, None)),
    ],
)
def test_header_objectives_are_ascii_digits_within_bounds(
    ttft: str | None, tpot: str | None, expected: tuple[float | None, float | None]
) -> None:
    """x-slo-ttft-ms / x-slo-tpot-ms: 1 ms to an hour of ASCII digits, anything else ignored."""
    headers = {k: v for k, v in (("x-slo-ttft-ms", ttft), ("x-slo-tpot-ms", tpot)) if v is not None}
    assert header_objectives(headers) == expected


def test_a_request_with_an_objective_prefers_endpoints_predicted_to_meet_it() -> None:
    """Endpoints predicted (P90) within x-slo-ttft-ms score at least 0.5, the others below."""
    fast, slow = endpoint(), endpoint(queue=20)
    source = source_with(QUEUE_BOUND, [fast, slow])
    scorer = PredictedLatencyScorer(source)
    scores = scorer.score(completion({"x-slo-ttft-ms": "500"}), [fast, slow])
    assert scores[0] >= 0.5 > scores[1]
    # without the objective the same endpoints are ranked by cost alone
    plain = scorer.score(completion(), [fast, slow])
    assert plain[0] == 1.0
    assert 0 < plain[1] < 0.5


def detector(source: PredictionSource) -> PredictedLatencyDetector:
    return PredictedLatencyDetector(
        source, factor=1.5, critical_factor=3.0, staleness=0.2, clock=clock
    )


@pytest.mark.parametrize(
    ("queues", "standard_room", "critical_room"),
    [
        ((0, 0), 2, 2),  # unloaded: room for all
        ((10, 0), 1, 1),  # one endpoint far past the objective: the other has room
        ((10, 10), 0, 0),  # both far past: saturated for every band
        ((1, 1), 0, 2),  # 2x the unloaded TTFT: past Standard's 1.5x, within Critical's 3x
    ],
)
def test_detector_holds_a_band_only_when_no_endpoint_meets_its_objective(
    queues: tuple[int, int], standard_room: int, critical_room: int
) -> None:
    """Room for a band on an endpoint while a typical request's predicted TTFT there is within
    the band's factor of its unloaded prediction; saturated only when no endpoint has room."""
    endpoints = [endpoint(queue=q) for q in queues]
    source = source_with((0.1, 0.005, 0.005, 1.0, 0.0, 0.0), endpoints)  # 100 ms a request waiting
    source.typical_ktok = 0.2
    d = detector(source)
    assert len(d.with_room_for(endpoints, 0)) == standard_room
    assert len(d.with_room_for(endpoints, 1)) == critical_room
    assert d.is_saturated(endpoints) == (standard_room == 0)


def test_detector_counts_stale_metrics_as_no_room() -> None:
    """An endpoint not scraped for longer than metricsStalenessThreshold may be drowning."""
    e = endpoint(age=1.0)
    assert detector(source_with(QUEUE_BOUND, [e])).is_saturated([e])


def test_the_plugins_share_one_predictor_subscribed_once() -> None:
    """The scorer and the detector of one build read the same predictor; the lifecycle tells it
    each event once, and the objective headers are collected from requests."""
    components = build(
        HEADER
        + """plugins:
- type: predicted-latency-scorer
- type: predicted-latency-detector
"""
    )
    scheduler = components.scheduler
    profile = scheduler.profiles["default"]
    assert profile.plugins["scorers"] == ["predicted-latency-scorer (weight 1)"]
    detector_source = components.saturation_detector._source  # type: ignore[attr-defined]
    e = endpoint()
    request = completion()
    scheduler.schedule(request, [e])
    Lifecycle.of(components.subscribers).routed(request, e.hostport)
    assert detector_source.predictor.ahead(e.hostport)[1] == 1  # counted once, not twice
    assert {"x-slo-ttft-ms", "x-slo-tpot-ms"} <= components.request_headers


def test_detector_uses_the_objectives_requests_of_the_band_carry() -> None:
    """A band's objectives seen on its recent requests (headers; for TPOT also the model's
    per-token objective) decide its room: Critical's replaces the default, a lower band's can
    only tighten it; they expire after OBJECTIVE_WINDOW."""
    e = endpoint(queue=1)  # 2x the unloaded TTFT (0.2 s against 0.1)
    source = source_with((0.1, 0.005, 0.005, 1.0, 0.0, 0.0), [e])
    scorer = PredictedLatencyScorer(source, clock=clock)
    d = detector(source)  # default factors: Standard 1.5x (held), Critical 3x (room)
    assert (len(d.with_room_for([e], 0)), len(d.with_room_for([e], 1))) == (0, 1)
    # Critical's own objective of 150 ms (tighter than 3x): now held
    critical = replace(completion({"x-slo-ttft-ms": "150"}), criticality=Criticality.CRITICAL)
    scorer.score(critical, [e])
    assert d.with_room_for([e], 1) == []
    # a Standard request with a loose objective does not loosen Standard's default
    scorer.score(completion({"x-slo-ttft-ms": "60000"}), [e])
    assert d.with_room_for([e], 0) == []
    # a per-token objective (the seed's, on the model) tighter than the predicted TPOT holds
    idle = endpoint()
    source.predictor.model(idle.hostport).ttft.theta = [0.1, 0.005, 0.005, 1.0, 0.0, 0.0]
    assert len(d.with_room_for([idle], -1)) == 1
    scorer.score(replace(completion(), priority=-1, latency_objective=0.001), [idle])
    assert d.with_room_for([idle], -1) == []


def test_band_objectives_expire() -> None:
    """An objective not seen for OBJECTIVE_WINDOW no longer holds its band."""
    source = source_with(QUEUE_BOUND, [])
    source.note_objectives(1, 0.15, None, now=10.0)
    assert source.objectives(1, 10.0 + OBJECTIVE_WINDOW) == (0.15, None)
    assert source.objectives(1, 10.1 + OBJECTIVE_WINDOW) == (None, None)
    source.note_objectives(1, 0.5, None, now=100.0)  # the tightest expired: the latest holds
    assert source.objectives(1, 100.0) == (0.5, None)


def test_band_objectives_are_kept_for_at_most_max_priorities_bands() -> None:
    """However many priorities objectives arrive with, at most MAX_PRIORITIES bands are kept:
    one more is dropped, the ones already kept still update."""
    source = source_with(QUEUE_BOUND, [])
    for priority in range(MAX_PRIORITIES + 100):
        source.note_objectives(priority, 0.2, None, now=1.0)
    assert source.objectives(MAX_PRIORITIES + 5, 1.0) == (None, None)
    assert source.objectives(0, 1.0) == (0.2, None)
    source.note_objectives(0, 0.1, None, now=2.0)
    assert source.objectives(0, 2.0) == (0.1, None)
    assert sum(source.objectives(p, 2.0)[0] is not None for p in range(MAX_PRIORITIES + 100)) == (
        MAX_PRIORITIES
    )


@pytest.mark.parametrize(("others_weight", "winner"), [(0.0, "idle"), (1.0, "cached")])
def test_a_miss_counts_the_delay_its_prefill_adds_to_the_requests_already_there(
    others_weight: float, winner: str
) -> None:
    """Waiting 100 ms behind one request where the prefix is cached loses to an 80 ms prefill
    elsewhere for the request alone, but wins once the 20 requests running there, each held up
    by that prefill, are counted (othersWeight)."""
    law = (0.01, 0.02, 0.0, 1.0, 0.0, 0.0)  # 20 ms per 1,000 uncached tokens, 100 ms a waiting
    cached, idle = endpoint(queue=1, running=20), endpoint(running=20)
    source = source_with(law, [cached, idle])
    cache_prompt_on(source, cached)
    scorer = PredictedLatencyScorer(source, others_weight=others_weight)
    scores = scorer.score(completion(), [cached, idle])
    assert ("cached" if scores[0] > scores[1] else "idle") == winner


def test_a_new_prefix_goes_where_placement_puts_it_among_equal_costs() -> None:
    """Idle endpoints, no prefix held: every replica's scorer prefers the same endpoint (the
    rendezvous winner of the prompt's first block), whatever the candidates' order."""
    endpoints = [endpoint() for _ in range(4)]
    request = completion()
    winners = set()
    for order in (endpoints, endpoints[::-1], endpoints[1:] + endpoints[:1]):
        source = source_with(PREFILL_BOUND, endpoints)
        scores = PredictedLatencyScorer(source).score(request, order)
        winners.add(order[max(range(4), key=scores.__getitem__)].hostport)
        assert sorted(scores)[-2] < 1.0  # one winner, not a tie
    assert len(winners) == 1


def test_a_new_prefix_is_not_placed_on_an_endpoint_over_its_share_of_new_prefixes() -> None:
    """Rendezvous hashing picks among the endpoints that have not taken more than their share
    of the prefixes placed lately: new prefixes fill the endpoints evenly, so the load their
    requests bring stays even (the winner by hash alone is passed over once it is ahead)."""
    endpoints = [endpoint() for _ in range(4)]
    source = source_with(PREFILL_BOUND, endpoints)
    scorer = PredictedLatencyScorer(source)
    lifecycle = Lifecycle([source], [source], [source])
    counts = dict.fromkeys((e.hostport for e in endpoints), 0)
    for i in range(40):
        prompt = {"prompt": f"group {i} " * 300 + "question?"}
        request = replace(completion(), body=prompt, stream=False)  # no sample: the law stays
        scores = scorer.score(request, endpoints)
        chosen = endpoints[max(range(4), key=scores.__getitem__)].hostport
        lifecycle.routed(request, chosen)
        lifecycle.started(request.request_id)
        lifecycle.finished(request.request_id, True)  # no load left behind to spread them
        counts[chosen] += 1
    assert max(counts.values()) <= 11  # 10 each, one ahead at most


def test_a_new_prefix_never_goes_to_an_endpoint_past_its_share_though_it_looks_idlest() -> None:
    """At a cold start the idlest-looking endpoint would take every new prefix its cost favours;
    past its share of new prefixes it scores 0 for one, and still competes for cached ones."""
    idle, busy = endpoint(), endpoint(queue=5)
    source = source_with(QUEUE_BOUND, [idle, busy])
    scorer = PredictedLatencyScorer(source)
    for _ in range(4):
        source.shares.add(idle.hostport)  # idle took the last four new prefixes
    scores = scorer.score(completion(), [idle, busy])
    assert scores == [0.0, 1.0]
    cache_prompt_on(source, idle)  # a request whose prefix idle holds is not a new prefix
    scores = scorer.score(completion(), [idle, busy])
    assert scores[0] == 1.0


def test_the_unloaded_bound_is_floored_by_the_fastest_observed_first_tokens() -> None:
    """A fit whose intercept came out near zero would call any load "2x unloaded"; the bound
    is at least factor x about the 10th percentile of the endpoint's observed TTFT."""
    e = endpoint(queue=1)
    source = source_with((0.0, 0.0, 0.0, 0.3, 0.0, 0.0), [e])  # unloaded: the 1 ms clamp
    source.predictor.model(e.hostport).ttft.log_var = 0.0
    d = detector(source)
    assert d.with_room_for([e], 0) == []  # 30 ms against 1.5 x 1 ms
    for ttft in [0.025] * 50:  # first tokens seen in 25 ms
        source.predictor.model(e.hostport).observe_fast(ttft)
    assert d.with_room_for([e], 0) == [e]  # 30 ms within 1.5 x 25 ms


def test_the_configured_detector_keeps_waiting_in_the_epp() -> None:
    """Built from config, an endpoint with a request waiting has no room (queueDepthThreshold 0
    by default), however good its prediction: requests wait in flow control's priority queues,
    not in a server's first-come queue."""
    components = build(HEADER + "plugins:\n- type: predicted-latency-detector\n")
    queued, idle = endpoint(queue=1), endpoint()
    assert components.saturation_detector.with_room([queued, idle]) == [idle]  # type: ignore[attr-defined]


def adapter_request(model: str) -> LLMRequest:
    return replace(completion(), model=model, target_model=model)


def test_an_adapter_to_load_behind_full_slots_costs_its_predicted_wait() -> None:
    """A LoRA request goes where its adapter runs, even behind a short queue, rather than to an
    idle endpoint whose slots other adapters hold (load + wait for a slot); with a slot free
    there, the load alone (30 ms) is cheaper than the queue and the idle endpoint wins."""
    running = endpoint(queue=1, active=["sql"], max_lora=2)
    full = endpoint(active=["a", "b"], max_lora=2)
    free = endpoint(active=["a"], max_lora=2)
    law = (0.01, 0.005, 0.005, 1.0, 0.002, 0.0, 0.03, 0.5)  # a waiting request costs 100 ms
    source = source_with(law, [running, full, free])
    scorer = PredictedLatencyScorer(source)
    to_full = scorer.score(adapter_request("sql"), [running, full])
    assert to_full[0] > to_full[1]
    to_free = scorer.score(adapter_request("sql"), [running, free])
    assert to_free[1] > to_free[0]


def test_a_base_model_request_has_no_adapter_cost() -> None:
    """The base model named by the endpoints' metrics loads nothing: every endpoint's adapter
    features are zero, whatever their slots hold."""
    a = endpoint(active=["x", "y"], max_lora=2, base=["m"])
    b = endpoint(active=[], max_lora=2, base=["m"])
    source = source_with(PREFILL_BOUND, [a, b])
    features = source.features(completion(), [a, b])
    assert [f[0][6:] for f in features] == [(0.0, 0.0), (0.0, 0.0)]
    lora = source.features(adapter_request("z"), [a, b])
    assert [f[0][6:] for f in lora] == [(1.0, 1.0), (1.0, 0.0)]


FLOW_CONTROL = "featureGates: [flowControl]\n"


@pytest.mark.parametrize("gate", ["", FLOW_CONTROL], ids=["flow-control-off", "flow-control-on"])
def test_the_default_detector_judges_by_predicted_latency_when_requests_can_wait(
    gate: str,
) -> None:
    """A config that names no detector gets ``predicted-latency-detector`` with flow control
    on (a held band waits in the EPP) and the reference's ``utilization-detector`` with it
    off (a held Sheddable request would get 429)."""
    components = build(HEADER + gate + "plugins:\n- type: queue-scorer\n")
    detector = components.saturation_detector
    assert isinstance(detector, PredictedLatencyDetector) == bool(gate)
    assert (components.latency_predictor is not None) == bool(gate)


def test_the_detector_alone_learns_from_the_requests_it_admits() -> None:
    """With no predicted-latency-scorer in the profile, a routed request is featured on its
    endpoint on routing (from the candidates the detector judged), so its first bytes teach the
    TTFT model and its header objective is kept for its band."""
    components = build(HEADER + FLOW_CONTROL + "plugins:\n- type: queue-scorer\n")
    predictor = components.latency_predictor
    assert predictor is not None
    lifecycle = Lifecycle.of(components.subscribers)
    e = endpoint()
    for _ in range(3):
        request = completion({"x-slo-ttft-ms": "250"})
        components.saturation_detector.with_room([e])
        lifecycle.routed(request, e.hostport)
        lifecycle.started(request.request_id)
        lifecycle.finished(request.request_id, True)
    assert predictor.model(e.hostport).ttft.samples == 3
    source = components.saturation_detector._source  # type: ignore[attr-defined]
    assert source.objectives(0, clock())[0] == pytest.approx(0.25)


def test_adapters_routed_and_unfinished_count_before_a_scrape_shows_them() -> None:
    """Between two scrapes, an adapter this EPP routed to an endpoint counts as loaded there
    (no load for its next request) and takes a slot (another adapter now waits); finishing
    the request gives both back."""
    a = endpoint(active=["x"], max_lora=2)
    source = source_with(PREFILL_BOUND, [a])
    lifecycle = Lifecycle([source], [source], [source])
    first = adapter_request("sql")
    assert source.features(first, [a])[0][0][6:] == (1.0, 0.0)  # a free slot: a load
    lifecycle.routed(first, a.hostport)
    assert source.features(adapter_request("sql"), [a])[0][0][6:] == (0.0, 0.0)
    assert source.features(adapter_request("chat"), [a])[0][0][6:] == (1.0, 1.0)
    lifecycle.finished(first.request_id, True)
    assert source.features(adapter_request("chat"), [a])[0][0][6:] == (1.0, 0.0)


def test_adapter_flights_are_bounded_and_forget_endpoints_that_left() -> None:
    """Requests whose finish never comes are dropped past ``REQUESTS_REMEMBERED``, releasing
    their adapter; an endpoint that left the pool is forgotten."""
    flights = AdapterFlights()
    for i in range(REQUESTS_REMEMBERED + 5):
        flights.routed(f"r{i}", "10.0.0.1:8000", f"adapter-{i}")
    assert len(flights.on("10.0.0.1:8000")) == REQUESTS_REMEMBERED
    assert "adapter-0" not in flights.on("10.0.0.1:8000")
    flights.on_endpoints(frozenset({"10.0.0.2:8000"}))
    assert flights.on("10.0.0.1:8000") == frozenset()


def test_features_of_no_candidates_place_nothing() -> None:
    """A request featured over no candidates (every one filtered out) gets no placement rather
    than an error."""
    source = source_with(PREFILL_BOUND, [])
    assert source.features(completion(), []) == []
    assert source.placed is None
