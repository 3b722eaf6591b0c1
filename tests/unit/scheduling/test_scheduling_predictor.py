"""The online latency predictor: it learns a known law, forgets an old one, starts from its prior
or the pooled model, keeps bounded state, and its P90 sits above its mean."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
from tests.unit.scheduling.builders import request

from endpoint_picker.scheduling.lifecycle import REQUESTS_REMEMBERED, Finished, Routed
from endpoint_picker.scheduling.predictor import TPOT_PRIOR, TTFT_PRIOR, LatencyPredictor
from endpoint_picker.scheduling.rls import OnlineLinear

_ids = itertools.count()

# seconds per unit of each TTFT feature (1, uncached ktok, ahead ktok, waiting/10, running/10, kv,
# adapter load, adapter wait)
LAW_A = (0.01, 0.03, 0.025, 0.05, 0.01, 0.02, 0.04, 0.2)
LAW_B = (0.03, 0.09, 0.075, 0.15, 0.03, 0.06, 0.12, 0.6)  # the same server three times slower
TPOT_LAW = (0.008, 0.004, 0.001, 0.002)  # (1, batch/10, ahead ktok, kv)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def features(rng: random.Random) -> tuple[tuple[float, ...], tuple[float, ...]]:
    load = float(rng.random() < 0.3)
    ttft = (1.0, rng.uniform(0, 4), rng.uniform(0, 8), rng.uniform(0, 2), rng.uniform(0, 3),
            rng.uniform(0, 1), load, load * float(rng.random() < 0.5))  # fmt: skip
    return ttft, (1.0, rng.uniform(0, 4), ttft[2], ttft[5])


def serve(
    predictor: LatencyPredictor,
    clock: Clock,
    endpoint: str,
    law: Sequence[float],
    n: int,
    *,
    noise: float = 0.0,
    seed: int = 1,
    stream: bool = True,
) -> None:
    """``n`` requests on ``endpoint`` whose TTFT follows ``law`` (times 1 + uniform noise)."""
    rng = random.Random(seed)
    for _ in range(n):
        x, tx = features(rng)
        req = replace(request(), request_id=f"r{next(_ids)}", stream=stream)
        predictor.expect(req.request_id, {endpoint: (x, tx)})
        predictor.on_routed(Routed(req, endpoint))
        clock.now += dot(law, x) * (1 + rng.uniform(-noise, noise))
        predictor.on_started(req.request_id)
        clock.now += dot(TPOT_LAW, tx) * 99
        predictor.on_finished(Finished(req.request_id, True, None, 100))


def predicted_ttft(predictor: LatencyPredictor, endpoint: str, x: Sequence[float]) -> float:
    return predictor.predict(endpoint, x, (1.0, 1.0, 0.0, 0.0)).ttft


PROBES = [
    (1.0, 4.0, 0.0, 0.0, 0.5, 0.1, 0.0, 0.0),
    (1.0, 0.05, 6.0, 1.0, 2.0, 0.6, 1.0, 0.0),
    (1.0, 1, 1, 1, 1, 1, 1, 1),
]


@pytest.mark.parametrize("law", [LAW_A, LAW_B])
def test_learns_a_known_linear_law_within_5_percent(law: tuple[float, ...]) -> None:
    """After 500 noisy samples (+-10%) the TTFT predictions are within 5% of the law."""
    clock = Clock()
    p = LatencyPredictor(clock)
    serve(p, clock, "e:1", law, 500, noise=0.1)
    for x in PROBES:
        assert predicted_ttft(p, "e:1", x) == pytest.approx(dot(law, x), rel=0.05)


def test_learns_tpot_from_the_batch_it_joins() -> None:
    """TPOT, from the first byte to the finish over the tokens after the first, fits its law."""
    clock = Clock()
    p = LatencyPredictor(clock)
    serve(p, clock, "e:1", LAW_A, 300)
    tx = (1.0, 3.0, 2.0, 0.5)
    assert p.predict("e:1", PROBES[0], tx).tpot == pytest.approx(dot(TPOT_LAW, tx), rel=0.05)


def test_forgets_a_law_that_changed() -> None:
    """A server that became 3x slower is predicted at its new speed within 10% after 600
    samples (the old law's weight is then 0.995^600 = 5%), and not before it changed."""
    clock = Clock()
    p = LatencyPredictor(clock)
    serve(p, clock, "e:1", LAW_A, 400, noise=0.1)
    assert predicted_ttft(p, "e:1", PROBES[2]) == pytest.approx(dot(LAW_A, PROBES[2]), rel=0.1)
    serve(p, clock, "e:1", LAW_B, 600, noise=0.1, seed=2)
    for x in PROBES:
        assert predicted_ttft(p, "e:1", x) == pytest.approx(dot(LAW_B, x), rel=0.1)


def test_cold_start_uses_the_physical_prior() -> None:
    """With no sample anywhere the prediction is the prior's."""
    p = LatencyPredictor(Clock())
    x, tx = PROBES[1], (1.0, 2.0, 6.0, 0.6)
    prediction = p.predict("e:1", x, tx)
    assert prediction.ttft == pytest.approx(dot(TTFT_PRIOR, x))
    assert prediction.tpot == pytest.approx(dot(TPOT_PRIOR, tx))


def test_a_new_endpoint_starts_from_the_pooled_model() -> None:
    """An endpoint never seen before predicts what the others taught, not the prior."""
    clock = Clock()
    p = LatencyPredictor(clock)
    serve(p, clock, "e:1", LAW_B, 150, seed=3)
    serve(p, clock, "e:2", LAW_B, 150, seed=4)
    x = PROBES[0]
    assert predicted_ttft(p, "e:new", x) == pytest.approx(dot(LAW_B, x), rel=0.1)
    assert abs(dot(TTFT_PRIOR, x) - dot(LAW_B, x)) > 0.2 * dot(LAW_B, x)  # the prior differs


def test_p90_is_above_the_mean_with_noise_and_the_error_is_reported() -> None:
    """Noisy samples give a P90 above the mean, and a relative error near the noise's size."""
    clock = Clock()
    p = LatencyPredictor(clock)
    serve(p, clock, "e:1", LAW_A, 300, noise=0.4)
    prediction = p.predict("e:1", PROBES[2], (1.0, 1.0, 1.0, 1.0))
    assert prediction.ttft_p90 > 1.1 * prediction.ttft
    assert 0.05 < p.errors()["e:1"] < 0.4


def test_non_streamed_requests_teach_nothing() -> None:
    """A non-streamed response's first bytes are its last: no TTFT (nor TPOT) sample."""
    clock = Clock()
    p = LatencyPredictor(clock)
    serve(p, clock, "e:1", LAW_B, 50, stream=False)
    assert p.samples("e:1") == (0, 0)
    assert predicted_ttft(p, "e:1", PROBES[0]) == pytest.approx(dot(TTFT_PRIOR, PROBES[0]))


def test_work_ahead_counts_routed_requests_until_they_start() -> None:
    """Uncached tokens routed to an endpoint count as its work ahead until their first bytes
    (or their finish, for a stream that never started)."""
    p = LatencyPredictor(Clock())
    x = (1.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    a, b = (replace(request(), request_id=f"r{next(_ids)}", stream=True) for _ in range(2))
    for req in (a, b):
        p.expect(req.request_id, {"e:1": (x, (1.0, 0.1, 0.0, 0.0))})
        p.on_routed(Routed(req, "e:1"))
    assert p.ahead("e:1") == (5.0, 2)
    p.on_started(a.request_id)
    assert p.ahead("e:1") == (2.5, 1)
    p.on_finished(Finished(b.request_id, False))
    assert p.ahead("e:1") == (0.0, 0)


def test_head_wait_is_the_age_of_the_oldest_streamed_request_not_started() -> None:
    """The head-of-line wait: how long the oldest streamed request routed to an endpoint and not
    started has waited; it moves on when that one starts or ends, and ignores requests that are
    not streamed (their first bytes are their last)."""
    clock = Clock()
    p = LatencyPredictor(clock)
    x = (1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    first, second, whole = (replace(request(), request_id=f"r{next(_ids)}") for _ in range(3))
    for req, stream in ((whole, False), (first, True), (second, True)):
        p.expect(req.request_id, {"e:1": (x, (1.0, 0.1, 0.0, 0.0))})
        p.on_routed(Routed(replace(req, stream=stream), "e:1"))
        clock.now += 1.0
    assert p.head_wait("e:1") == pytest.approx(2.0)  # first, routed at 101 (whole at 100)
    assert p.head_wait("e:2") == 0.0
    p.on_started(first.request_id)
    assert p.head_wait("e:1") == pytest.approx(1.0)
    p.on_finished(Finished(second.request_id, False))  # a stream that never started
    assert p.head_wait("e:1") == 0.0
    assert p._queued == {}


def test_state_is_bounded() -> None:
    """Requests that never finish are forgotten past REQUESTS_REMEMBERED (their work ahead and
    their place in the head-of-line queue with them); endpoints that leave the pool are dropped."""
    p = LatencyPredictor(Clock())
    x = (1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    for _ in range(REQUESTS_REMEMBERED + 50):
        req = replace(request(), request_id=f"r{next(_ids)}", stream=True)
        p.expect(req.request_id, {"e:1": (x, (1.0, 0.1, 0.0, 0.0))})
        p.on_routed(Routed(req, "e:1"))
    assert len(p._flights) == REQUESTS_REMEMBERED
    assert p.ahead("e:1") == (pytest.approx(float(REQUESTS_REMEMBERED)), REQUESTS_REMEMBERED)
    assert len(p._queued["e:1"]) == REQUESTS_REMEMBERED
    p.predict("e:2", x, (1.0, 0.1, 0.0, 0.0))
    p.on_endpoints(frozenset({"e:2"}))
    assert p.ahead("e:1") == (0.0, 0)
    assert p.head_wait("e:1") == 0.0
    assert set(p._models) == {"e:2"}


def test_covariance_stays_bounded_while_a_feature_never_moves() -> None:
    """Forgetting with a constant input cannot blow the covariance up (windup is capped)."""
    model = OnlineLinear(TTFT_PRIOR, 0.99)
    for _ in range(5000):
        model.update((1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), 0.05)
    assert sum(model.p[i][i] for i in range(6)) <= 6.0 + 1e-9
    assert model.mean((1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)) == pytest.approx(0.05, rel=0.01)
