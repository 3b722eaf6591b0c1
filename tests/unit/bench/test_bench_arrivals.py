"""Arrival processes: mean rate kept by every kind, burstiness as the gaps' variance, bad input."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from endpoint_picker.bench.arrivals import ARRIVALS, arrival_times, check_arrival
from endpoint_picker.bench.model import BenchError


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


@pytest.mark.parametrize(
    ("kind", "burstiness"),
    [("poisson", 1.0), ("constant", 1.0), ("bursty", 0.25), ("bursty", 1.0), ("bursty", 4.0)],
)
def test_mean_rate_kept(kind: str, burstiness: float) -> None:
    """Over a long run every kind delivers the asked rate within 3%, inside [0, duration)."""
    times = arrival_times(kind, 100.0, 200.0, random.Random(7), burstiness)
    assert len(times) == pytest.approx(20_000, rel=0.03)
    assert times == sorted(times)
    assert times[0] >= 0.0
    assert times[-1] < 200.0


def test_constant_is_evenly_spaced_from_start() -> None:
    """Constant arrivals start at the start and come exactly every 1/rate, none at the end."""
    times = arrival_times("constant", 4.0, 2.0, random.Random(1), start=-1.0)
    assert times == pytest.approx([-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75])


def test_burstiness_sets_the_variance_of_gaps() -> None:
    """Gamma gaps have squared CV = 1/burstiness: lower burstiness, burstier arrivals."""
    cv2 = {}
    for b in (0.25, 1.0, 4.0):
        gaps = _gaps(arrival_times("bursty", 50.0, 400.0, random.Random(3), b))
        cv2[b] = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2[0.25] == pytest.approx(4.0, rel=0.15)
    assert cv2[1.0] == pytest.approx(1.0, rel=0.1)
    assert cv2[4.0] == pytest.approx(0.25, rel=0.1)
    poisson = _gaps(arrival_times("poisson", 50.0, 400.0, random.Random(3)))
    assert statistics.pvariance(poisson) < statistics.pvariance(
        _gaps(arrival_times("bursty", 50.0, 400.0, random.Random(3), 0.25))
    )


def test_window_with_start_offset() -> None:
    """With a start, times fall in [start, start + duration)."""
    times = arrival_times("poisson", 20.0, 10.0, random.Random(2), start=-5.0)
    assert times[0] >= -5.0
    assert times[-1] < 5.0


def test_same_random_same_times() -> None:
    """Equal seeds give equal times; another seed gives others."""
    a = arrival_times("bursty", 10.0, 30.0, random.Random(5), 0.5)
    assert a == arrival_times("bursty", 10.0, 30.0, random.Random(5), 0.5)
    assert a != arrival_times("bursty", 10.0, 30.0, random.Random(6), 0.5)


@pytest.mark.parametrize(
    ("kind", "rate", "duration", "burstiness", "message"),
    [
        ("uniform", 1.0, 1.0, 1.0, "unknown arrival 'uniform'"),
        ("poisson", 0.0, 1.0, 1.0, "rate must be above 0"),
        ("poisson", 1.0, -1.0, 1.0, "duration must be above 0"),
        ("bursty", 1.0, 1.0, 0.0, "burstiness must be above 0"),
        ("poisson", 1.0, 1.0, 0.5, "burstiness applies to --arrival bursty only"),
        ("constant", 1.0, 1.0, float("nan"), "burstiness must be above 0"),
    ],
)
def test_bad_arrivals_are_bench_errors(
    kind: str, rate: float, duration: float, burstiness: float, message: str
) -> None:
    """Each impossible arrival process is refused with a message naming the problem."""
    with pytest.raises(BenchError, match=message):
        check_arrival(kind, rate, duration, burstiness)


def test_every_kind_is_described() -> None:
    """The listing names the three kinds with a description each."""
    assert set(ARRIVALS) == {"poisson", "constant", "bursty"}
    assert all(ARRIVALS.values())
