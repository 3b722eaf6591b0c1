"""Outlier detection: consecutive failures eject, a probe brings back, caps hold (fake clock)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import pytest

from endpoint_picker.datastore.health import FailureKind, OutlierDetector, OutlierState
from endpoint_picker.settings import OutlierSettings

FOUR = ("a", "b", "c", "d")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Observer:
    failures: list[tuple[str, str]] = field(default_factory=list)
    ejections: list[str] = field(default_factory=list)
    forgotten: list[str] = field(default_factory=list)

    def endpoint_failed(self, hostport: str, kind: str) -> None:
        self.failures.append((hostport, kind))

    def endpoint_ejected(self, hostport: str) -> None:
        self.ejections.append(hostport)

    def endpoints_forgotten(self, hostports: Iterable[str]) -> None:
        self.forgotten.extend(hostports)


def run(
    events: Iterable[tuple[str, object]],
    *,
    ready: tuple[str, ...] = FOUR,
    settings: OutlierSettings | None = None,
) -> tuple[OutlierDetector, Clock, Observer]:
    """Play ``events``: ("fail"|"ok"|"route"|"unanswered"|"pool", endpoint or endpoints) or
    ("wait", seconds); a "fail" of "a*5" is five failures of a."""
    clock, observer = Clock(), Observer()
    detector = OutlierDetector(settings or OutlierSettings(), clock=clock, observer=observer)
    for kind, arg in events:
        if kind == "wait":
            assert isinstance(arg, float | int)
            clock.now += arg
            continue
        if kind == "pool":
            assert isinstance(arg, tuple)
            ready = arg
            detector.endpoints_changed(arg)
            continue
        assert isinstance(arg, str)
        name, _, times = arg.partition("*")
        for _ in range(int(times or 1)):
            if kind == "fail":
                detector.failed(name, FailureKind.STATUS_5XX, ready)
            elif kind == "ok":
                detector.succeeded(name)
            elif kind == "route":
                detector.routed(name)
            elif kind == "unanswered":
                detector.unanswered(name)
            else:
                raise AssertionError(kind)
    return detector, clock, observer


CASES = [
    # (id, events, ready, settings, excluded after the events)
    ("four failures are not enough", [("fail", "a*4")], FOUR, None, set()),
    ("the fifth in a row ejects", [("fail", "a*5")], FOUR, None, {"a"}),
    ("a success resets the count", [("fail", "a*4"), ("ok", "a"), ("fail", "a*4")], FOUR, None,
     set()),
    ("still out just before the base time", [("fail", "a*5"), ("wait", 29.9)], FOUR, None, {"a"}),
    ("back as a candidate after it", [("fail", "a*5"), ("wait", 30)], FOUR, None, set()),
    ("its probe in flight keeps it out",
     [("fail", "a*5"), ("wait", 30), ("route", "a")], FOUR, None, {"a"}),
    ("a successful probe brings it back",
     [("fail", "a*5"), ("wait", 30), ("route", "a"), ("ok", "a")], FOUR, None, set()),
    ("a failed probe ejects again at once",
     [("fail", "a*5"), ("wait", 30), ("route", "a"), ("fail", "a")], FOUR, None, {"a"}),
    ("the second ejection lasts twice the base",
     [("fail", "a*5"), ("wait", 30), ("fail", "a"), ("wait", 59.9)], FOUR, None, {"a"}),
    ("and is over after it",
     [("fail", "a*5"), ("wait", 30), ("fail", "a"), ("wait", 60)], FOUR, None, set()),
    ("an unanswered probe lets another request probe",
     [("fail", "a*5"), ("wait", 30), ("route", "a"), ("unanswered", "a")], FOUR, None, set()),
    ("a probe silent for a base ejection time lets another probe",
     [("fail", "a*5"), ("wait", 30), ("route", "a"), ("wait", 30)], FOUR, None, set()),
    ("a success of an older request does not end an ejection",
     [("fail", "a*5"), ("ok", "a"), ("wait", 10)], FOUR, None, {"a"}),
    ("half of four: two out, the third held in",
     [("fail", "a*5"), ("fail", "b*5"), ("fail", "c*5")], FOUR, None, {"a", "b"}),
    ("Envoy's 10%: at least one of four",
     [("fail", "a*5"), ("fail", "b*5")], FOUR,
     OutlierSettings(max_ejection_percent=10), {"a"}),
    ("never the last ready endpoint",
     [("fail", "a*5"), ("fail", "b*5")], ("a", "b"),
     OutlierSettings(max_ejection_percent=100), {"a"}),
    ("a pool of one is never ejected", [("fail", "a*50")], ("a",), None, set()),
    ("held in by the cap, ejected once there is room",
     [("fail", "a*5"), ("fail", "b*5"), ("fail", "c*5"), ("wait", 30), ("route", "a"),
      ("ok", "a"), ("fail", "c")], FOUR, None, {"c"}),  # b probes: a candidate again
    ("an endpoint not in the pool leaves no record", [("fail", "z*5")], FOUR, None, set()),
    ("an endpoint that left the pool is forgotten",
     [("fail", "a*5"), ("pool", ("b", "c", "d"))], ("b", "c", "d"), None, set()),
    ("the threshold is a setting", [("fail", "a*2")], FOUR,
     OutlierSettings(consecutive_failures=2), {"a"}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("events", "ready", "settings", "excluded"),
    [pytest.param(e, r, s, x, id=name) for name, e, r, s, x in CASES],
)
def test_outlier_detection(
    events: list[tuple[str, object]],
    ready: tuple[str, ...],
    settings: OutlierSettings | None,
    excluded: set[str],
) -> None:
    """Each sequence of outcomes leaves exactly the expected endpoints out of the candidates."""
    detector, _, _ = run(events, ready=ready, settings=settings)
    assert detector.excluded() == excluded


@pytest.mark.parametrize(
    ("ejections", "seconds"),
    [(1, 30), (2, 60), (3, 90), (10, 300), (20, 300)],
)
def test_ejection_time_grows_with_repeats_up_to_the_max(ejections: int, seconds: float) -> None:
    """The n-th ejection in a row lasts n x base ejection time, capped by max ejection time."""
    events: list[tuple[str, object]] = [("fail", "a*5")]
    for _ in range(ejections - 1):  # each ejection over, then its probe fails
        events += [("wait", 300), ("route", "a"), ("fail", "a")]
    detector, _, _ = run(events)
    status = detector.status("a")
    assert status is not None
    assert status.state is OutlierState.EJECTED
    assert status.ejections == ejections
    assert status.seconds_left == seconds


def test_healthy_time_forgives_past_ejections() -> None:
    """Back for two base ejection times, an endpoint's next ejection is its first again."""
    back = [("fail", "a*5"), ("wait", 30), ("fail", "a"), ("wait", 60), ("route", "a"), ("ok", "a")]
    detector, _, _ = run([*back, ("wait", 2 * 30), ("fail", "a*5")])
    status = detector.status("a")
    assert status is not None
    assert (status.ejections, status.seconds_left) == (1, 30)


def test_status_and_observer_follow_the_endpoint() -> None:
    """The status names state, failures and time left; the observer counts every failure."""
    detector, clock, observer = run([("fail", "a*3")])
    status = detector.status("a")
    assert status is not None
    assert (status.state, status.consecutive_failures, status.seconds_left) == (
        OutlierState.OK,
        3,
        None,
    )
    detector.failed("a", FailureKind.RETRIED, FOUR)
    detector.failed("a", FailureKind.CONNECT, FOUR)
    clock.now += 10
    status = detector.status("a")
    assert status is not None
    assert (status.state, status.consecutive_failures, status.last_failure) == (
        OutlierState.EJECTED,
        5,
        "connect",
    )
    assert status.seconds_left == 20
    assert detector.ejected() == ["a"]
    assert observer.failures[-2:] == [("a", "retried"), ("a", "connect")]
    assert observer.ejections == ["a"]
    clock.now += 20
    detector.routed("a")
    status = detector.status("a")
    assert status is not None
    assert (status.state, status.probe_in_flight) == (OutlierState.PROBING, True)
    assert detector.ejected() == []
    detector.endpoints_changed(["b"])
    assert detector.status("a") is None
    assert observer.forgotten == ["a"]


def test_a_healthy_endpoint_keeps_no_record() -> None:
    """Successes of endpoints that never failed, or whose failures are forgiven, cost nothing."""
    detector, _, _ = run([("ok", "a*100"), ("fail", "b"), ("ok", "b")])
    assert detector.status("a") is None
    assert detector.status("b") is None
    assert replace(OutlierSettings(), consecutive_failures=0).enabled is False
