"""``epp bench soak``'s parts without a stack: the verdicts, the tally, the mix, the parsing."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from endpoint_picker.bench.cli import build_parser
from endpoint_picker.bench.soak.load import KINDS, Mix, Tally
from endpoint_picker.bench.soak.sampler import epp_values
from endpoint_picker.bench.soak.verdict import failed, judge
from endpoint_picker.bench.stats import percentile

IDLE = {"rss_mib": 100.0, "fds": 40.0, "tasks": 12.0, "running": 0.0, "streams": 0.0}


def samples(rss_per_hour: float, *, after: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """An idle sample, an hour of load sampled every minute (RSS growing as asked), one after."""
    rows: list[dict[str, Any]] = [{"t": 0.0, "phase": "start", **IDLE, "buffered_kib": 0.0}]
    for minute in range(1, 61):
        rows.append(
            {
                "t": minute * 60.0,
                "phase": "load",
                **IDLE,
                "rss_mib": 100.0 + rss_per_hour * minute / 60 + (0.05 if minute % 2 else 0.0),
                "tasks": 30.0,
                "running": 4.0 + minute % 3,
                "streams": 4.0,
                "buffered_kib": 2.0,
            }
        )
    rows.append({"t": 3700.0, "phase": "after", **IDLE, "buffered_kib": 0.0, **(after or {})})
    return rows


def verdict_of(verdicts: list[dict[str, Any]], series: str) -> str:
    return str(next(v["verdict"] for v in verdicts if v["series"] == series))


def test_a_flat_run_passes() -> None:
    """RSS within its budget and every gauge back to idle: every series flat, the soak passes."""
    verdicts = judge(samples(rss_per_hour=1.0), warmup=0.0)
    assert verdict_of(verdicts, "rss_mib") == "flat"
    assert not failed(verdicts)


def test_rss_growing_past_its_budget_fails() -> None:
    """RSS growing 50 MiB an hour (budget: 5% of 100 MiB) is GROWING, and the soak fails."""
    verdicts = judge(samples(rss_per_hour=50.0), warmup=0.0)
    assert verdict_of(verdicts, "rss_mib") == "GROWING"
    assert failed(verdicts)


def test_a_gauge_not_back_to_zero_fails() -> None:
    """A request still running after the load is a leak, whatever its trend."""
    verdicts = judge(samples(rss_per_hour=0.0, after={"running": 1.0}), warmup=0.0)
    assert "NOT BACK TO 0" in verdict_of(verdicts, "running")
    assert failed(verdicts)


def test_tasks_must_return_to_idle() -> None:
    """More event-loop tasks after the load than before it (plus 2) fails the soak."""
    verdicts = judge(samples(rss_per_hour=0.0, after={"tasks": 15.0}), warmup=0.0)
    assert "NOT BACK TO IDLE" in verdict_of(verdicts, "tasks")


def test_the_window_uses_the_package_percentile() -> None:
    """The tally's TTFT p90 is ``bench.stats.percentile``'s (interpolated), in ms; none is NaN."""
    tally = Tally()
    tally.w_ttft = [0.1, 0.2, 0.3, 0.4]
    window = tally.window(1.0)
    assert window["ttft_p90_ms"] == pytest.approx(percentile([0.1, 0.2, 0.3, 0.4], 90) * 1e3)
    assert window["ttft_p90_ms"] == pytest.approx(370.0)
    assert math.isnan(tally.window(1.0)["ttft_p90_ms"])  # the next window is empty


def test_ok_share_leaves_out_the_clients_meant_to_vanish() -> None:
    """Vanishing clients neither help nor hurt the share of complete 200s."""
    tally = Tally()
    for kind, status in [("stream", "200"), ("plain", "503"), (KINDS[2], "vanished")]:
        tally.outcome(kind, status)
    assert tally.ok_share() == 0.5
    assert tally.errors == {"HTTP 503": 1}


def test_the_mix_is_seeded_and_vanishes_as_asked() -> None:
    """The same seed gives the same bodies; about ``vanish`` of the clients vanish."""
    first, second = Mix(7, 0.2), Mix(7, 0.2)
    jobs = [first.next() for _ in range(2000)]
    assert jobs[:50] == [second.next() for _ in range(50)]
    vanishing = sum(job.kind.startswith("vanish") for job in jobs) / len(jobs)
    assert 0.15 < vanishing < 0.25
    body = orjson.loads(jobs[0].body)
    assert 16 <= body["max_tokens"] <= 64


def test_epp_values_sums_label_sets() -> None:
    """Each series is summed over its label sets; buffered bytes become KiB."""
    page = (
        "# HELP inference_model_running_requests x\n"
        'inference_model_running_requests{model_name="a"} 2\n'
        'inference_model_running_requests{model_name="b"} 3\n'
        "inference_extension_buffered_request_bytes 2048\n"
    )
    values = epp_values(page)
    assert values["running"] == 5.0
    assert values["buffered_kib"] == 2.0
    assert values["streams"] == 0.0


def test_soak_flags_parse() -> None:
    """``epp bench soak`` takes the former script's flags."""
    args = build_parser().parse_args(
        ["soak", "--rate", "125", "--duration", "60", "--warmup", "10", "--ramp", "10,20"]
    )
    assert (args.command, args.rate, args.ramp) == ("soak", 125.0, (10.0, 20.0))
