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
from endpoint_picker.scheduling.lifecycle import InFlight
from endpoint_picker.scheduling.plugins import PredictedLatencyDetector, PredictedLatencyScorer
from endpoint_picker.scheduling.plugins.predicted import (
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
# TTFT laws: seconds per (1, uncached ktok, ahead ktok, waiting/10, running/10, kv)
PREFILL_BOUND = (0.01, 0.05, 0.05, 0.02, 0.002, 0.0)  # a prefill costs more than a short queue
QUEUE_BOUND = (0.01, 0.005, 0.005, 1.0, 0.002, 0.0)  # each waiting request costs 100 ms


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
