"""The lock-free histogram exposes exactly what prometheus_client's Histogram would."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from endpoint_picker.telemetry.histogram import LoopHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)


def test_exposition_matches_prometheus_client() -> None:
    """Same observations (on and between bounds, below, above) give the same text."""
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = LoopHistogram("h_seconds", "doc", ["a"], BUCKETS)
    ours_registry.register(ours)
    theirs = Histogram("h_seconds", "doc", ["a"], buckets=BUCKETS, registry=theirs_registry)
    rng = random.Random(7)
    values = [0.0, 0.001, 0.01, 1.0, 10.0, 11.0, *(rng.uniform(0, 12) for _ in range(500))]
    for i, value in enumerate(values):
        label = "x" if i % 3 else "y"
        ours.labels(label).observe(value)
        theirs.labels(label).observe(value)
    mine = sorted(generate_latest(ours_registry).decode().splitlines())
    reference = sorted(
        line
        for line in generate_latest(theirs_registry).decode().splitlines()
        if "_created" not in line
    )
    assert mine == reference


def test_label_count_is_checked() -> None:
    """Wrong number of label values is an error, not a silent new series."""
    with pytest.raises(ValueError, match="expected labels"):
        LoopHistogram("h", "doc", ["a", "b"], BUCKETS).labels("only-one")
