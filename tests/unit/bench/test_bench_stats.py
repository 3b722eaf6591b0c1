"""Percentiles, per-target summaries and the validity check, on hand-built results."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tests.unit.bench.builders import record, result, server, steady

from endpoint_picker.bench.client import PREVIOUS_TURN_FAILED
from endpoint_picker.bench.model import RequestRecord, ServerObservation
from endpoint_picker.bench.stats import percentile, summarize, validity


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),  # rank 1.5: halfway between 2 and 3
        ([1.0, 2.0, 3.0, 4.0], 90, 3.7),  # rank 2.7
        ([1.0, 2.0, 3.0, 4.0], 25, 1.75),  # rank 0.75
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),  # unsorted input; q=0 is the minimum
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),  # q=100 is the maximum
        ([10.0, 20.0], 99, 19.9),  # rank 0.99
        ([5.0], 50, 5.0),  # one value is every percentile
        ([5.0], 99, 5.0),
    ],
)
def test_percentile_interpolates_between_closest_ranks(
    values: list[float], q: float, expected: float
) -> None:
    """percentile matches numpy's default (linear) on hand-computed cases."""
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_none() -> None:
    """No values: no percentile, rather than a made-up zero."""
    assert percentile([], 50) is None


@pytest.mark.parametrize(
    ("rec", "expected"),
    [
        (record(ttft=0.1, e2e=1.0, out=10), 0.1),  # 0.9 s over the 9 tokens after the first
        (record(ttft=0.2, e2e=0.2, out=1), None),  # one token: no inter-token time
        (record(ttft=None, e2e=None, out=0, status=503), None),
    ],
)
def test_tpot_is_time_after_first_token_per_later_token(
    rec: RequestRecord, expected: float | None
) -> None:
    """TPOT = (e2e - ttft) / (output tokens - 1), None below two tokens."""
    assert rec.tpot == (pytest.approx(expected) if expected is not None else None)


def test_summary_of_a_hand_built_result() -> None:
    """Summary counts errors by kind and computes req/s, tok/s, hit rate and load ratio."""
    records = (
        record(0, 0.0, ttft=0.1),
        record(1, 0.5, status=503, ttft=None, e2e=None, out=0, error="busy"),
        record(2, 1.0, ttft=0.2),
        record(3, 1.5, status=0, ttft=None, e2e=None, out=0, error="refused"),
        record(4, 2.0, ttft=0.3),  # last successful finish: 2.0 + 1.0
        record(5, 2.5, status=0, ttft=None, e2e=None, out=0, error=PREVIOUS_TURN_FAILED),
    )
    servers = (
        server("a:1", 30, queries=100, hits=25),
        server("b:1", 10, queries=50, hits=25),
        server("c:1", 20, queries=50, hits=0),
    )
    s = summarize(result(records, servers))
    assert (s.sent, s.completed) == (5, 3)
    assert s.errors == {"503": 1, "connection": 1, "skipped": 1}
    assert s.ttft_p50 == pytest.approx(0.2)
    assert s.requests_per_s == pytest.approx(3 / 3.0)  # 3 ok over first send 0 -> last end 3
    assert s.output_tokens_per_s == pytest.approx(30 / 3.0)
    assert s.hit_rate == pytest.approx(50 / 200)
    assert s.load_ratio == pytest.approx(30 / 20)
    assert s.per_server == (("a:1", 30), ("b:1", 10), ("c:1", 20))
    assert s.valid


def test_warmup_requests_are_sent_but_not_measured() -> None:
    """Only requests due at or after the warm-up enter the latencies, counts and rates; a
    schedule slip during the warm-up still makes the run invalid."""
    slow_cold = tuple(record(i, i * 0.1, ttft=5.0, e2e=9.0) for i in range(10))  # due 0-0.9
    warm = tuple(record(10 + i, 1.0 + i * 0.1, ttft=0.1) for i in range(10))  # due 1.0-1.9
    s = summarize(result(slow_cold + warm, warmup=1.0))
    assert (s.sent, s.completed) == (10, 10)
    assert s.ttft_p90 == pytest.approx(0.1)
    assert s.requests_per_s == pytest.approx(10 / (1.9 + 1.0 - 1.0))
    assert summarize(result(slow_cold + warm)).ttft_p90 == pytest.approx(5.0)
    lagging = (record(0, 0.0, sent=0.5), *warm)
    assert not summarize(result(lagging, warmup=1.0)).valid


def test_summary_without_data_has_none_not_zero() -> None:
    """No completions, no servers: rates, hit rate and load ratio are None, and it is invalid."""
    s = summarize(result((record(status=503, ttft=None, e2e=None),)))
    assert (s.requests_per_s, s.hit_rate, s.load_ratio, s.ttft_p50) == (None, None, None, None)
    assert not s.valid


def _sim(planned: float = 10.0, late: float = 0.1, behind: float = 0.0) -> ServerObservation:
    return server(planned=planned, late=late, behind=behind)


@pytest.mark.parametrize(
    ("records", "servers", "expected"),
    [
        (steady(), (_sim(),), []),  # clean: on time, clock 1% late, nothing lost
        (steady(), (server(),), []),  # a real vLLM has no sim:* series: nothing to check
        # the client fell behind: sends spread 10% wider (and lag on average)
        (tuple(record(i, i * 0.1, i * 0.11) for i in range(11)), (_sim(),),
         ["load generator slipped", "load generator lagged"]),
        # a constant 20 ms lag is 20% of the 100 ms gap
        (tuple(record(i, i * 0.1, i * 0.1 + 0.02) for i in range(11)), (_sim(),),
         ["load generator lagged"]),
        # 1 ms lag at 1,000 req/s is under the timer-resolution floor
        (tuple(record(i, i * 0.001, i * 0.001 + 0.001) for i in range(11)), (_sim(),), []),
        (steady(), (_sim(late=0.6),), ["simulated fleet ran late"]),  # 6% late
        (steady(), (_sim(behind=0.2),), ["simulated fleet fell behind"]),  # 2% of planned lost
        (steady(), (_sim(behind=0.05),), []),  # 0.5%: a stall on a shared machine, tolerated
        (steady(status=503, e2e=None), (_sim(),), ["no request completed"]),
    ],
)  # fmt: skip
def test_validity_names_each_slip(
    records: tuple[RequestRecord, ...], servers: tuple[ServerObservation, ...], expected: list[str]
) -> None:
    """Each validity rule triggers on its own slip, and a clean run has no reasons."""
    reasons = validity(result(records, servers))
    assert [r.split(":")[0] for r in reasons] == expected


def test_oracle_hit_rate_is_the_fleets_best_prefix_over_queried_tokens() -> None:
    """The oracle hit rate sums every server's sim:prefix_cache_oracle_hits over the queried
    tokens, beside the measured hit rate; a server without the counter makes it unknown."""
    servers = (
        replace(server("a:1", 10, queries=100, hits=20), oracle_hits=60.0),
        replace(server("b:1", 10, queries=100, hits=40), oracle_hits=80.0),
    )
    s = summarize(result((record(),), servers))
    assert s.hit_rate == pytest.approx(60 / 200)
    assert s.oracle_hit_rate == pytest.approx(140 / 200)
    real = (servers[0], server("c:1", 10, queries=100, hits=0))
    assert summarize(result((record(),), real)).oracle_hit_rate is None
