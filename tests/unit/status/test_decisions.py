"""The status page's ring of recent decisions: what it keeps, what it shows, what it never holds."""

from __future__ import annotations

from dataclasses import replace

import orjson
from tests.unit.scheduling.builders import endpoint

from endpoint_picker.errors import ErrorCode
from endpoint_picker.requests import Api, LLMRequest
from endpoint_picker.scheduling import Scheduler, build_scheduling
from endpoint_picker.settings import SchedulingSettings
from endpoint_picker.status.decisions import DecisionLog, Refusal

SECRET = "zebra-violet-4417"  # a prompt marker that must never be kept


class Wall:
    """Wall-clock time the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def routed_request(request_id: str = "r1") -> LLMRequest:
    body = {"model": "food", "prompt": f"tell me {SECRET}"}
    return LLMRequest(
        request_id=request_id,
        api=Api.COMPLETIONS,
        model="food",
        raw_body=orjson.dumps(body),
        body=body,
        target_model="food-v2",
    )


def test_a_routed_decision_shows_the_chosen_endpoint_its_scores_and_the_runner_up() -> None:
    """The chosen endpoint's total is the sum of its scorers' weighted shares; the runner-up
    is the best other endpoint that passed the filters."""
    log = DecisionLog()
    parts = build_scheduling(
        None, settings=SchedulingSettings(), staleness_threshold=2.0, record=log.record
    )
    eps = [endpoint("busy", queue=2, kv=0.5), endpoint("idle", queue=0, kv=0.1)]
    parts.scheduler.schedule(routed_request(), eps)
    (decision,) = log.recent()
    assert decision["requestId"] == "r1"
    assert (decision["model"], decision["targetModel"]) == ("food", "food-v2")
    assert decision["endpoints"] == [eps[1].hostport]
    assert (decision["profile"], decision["candidates"], decision["error"]) == ("default", 2, None)
    chosen, runner_up = decision["chosen"], decision["runnerUp"]
    assert chosen["endpoint"] == eps[1].hostport
    assert runner_up["endpoint"] == eps[0].hostport
    assert set(chosen["byScorer"]) == {
        "prefix-cache-scorer",
        "session-affinity-scorer",
        "inflight-load-scorer",
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "lora-affinity-scorer",
    }
    for scores in (chosen, runner_up):
        assert abs(sum(scores["byScorer"].values()) - scores["total"]) < 1e-3
    assert chosen["total"] > runner_up["total"]
    assert chosen["byScorer"]["queue-scorer"] == 1.0  # weight 1, the shortest queue
    assert runner_up["byScorer"]["queue-scorer"] == 0.0


def test_scores_are_kept_for_one_decision_per_interval_and_every_decision_is_listed() -> None:
    """Decisions closer than the interval keep their endpoints but not their scores."""
    log = DecisionLog()
    built = build_scheduling(None, settings=SchedulingSettings(), staleness_threshold=2.0)
    profiles = list(built.scheduler.profiles.values())
    handler = built.scheduler.handler
    scheduler = Scheduler(profiles, handler, record=log.record, scores_interval=3600.0)
    eps = [endpoint(), endpoint()]
    for i in range(3):
        scheduler.schedule(routed_request(f"r{i}"), eps)
    newest, middle, oldest = log.recent()
    assert [d["requestId"] for d in (newest, middle, oldest)] == ["r2", "r1", "r0"]
    assert oldest["chosen"] is not None
    assert [newest["chosen"], middle["chosen"], newest["passedFilters"]] == [None, None, None]
    assert newest["endpoints"][0] in {e.hostport for e in eps}  # the pick is always listed


def test_refusals_show_status_code_and_message_and_the_ring_is_bounded() -> None:
    """A refusal is listed with its status; past ``size`` the oldest entries go."""
    wall = Wall()
    log = DecisionLog(size=3, clock=wall)
    for i in range(5):
        wall.now += 1
        log.rejected(f"r{i}", "nope", "", ErrorCode.NOT_FOUND, f"model 'nope' is not served ({i})")
    assert len(log) == 3
    newest = log.recent()[0]
    assert newest["time"] == wall.now
    assert newest["requestId"] == "r4"
    assert (newest["model"], newest["targetModel"], newest["endpoints"]) == ("nope", "nope", [])
    assert newest["error"] == {
        "status": 404,
        "code": "NotFound",
        "message": "model 'nope' is not served (4)",
    }


def test_no_prompt_is_kept_or_shown() -> None:
    """The ring holds ids and names only: neither its JSON nor its records reach the body."""
    log = DecisionLog()
    parts = build_scheduling(
        None, settings=SchedulingSettings(), staleness_threshold=2.0, record=log.record
    )
    parts.scheduler.schedule(routed_request(), [endpoint(), endpoint()])
    assert SECRET not in orjson.dumps(log.recent()).decode()
    held = repr(list(log._ring))  # the records themselves, not just what is shown
    assert SECRET not in held
    assert "LLMRequest" not in held


HUGE = 2 * 1024 * 1024  # a client's model name, inside Envoy's body limit


def held_characters(log: DecisionLog) -> int:
    """Characters of every string the ring's records hold (what the ring keeps alive)."""
    total = 0
    for item in log._ring:
        fields = (
            (item.request_id, item.model, item.target_model, item.message)
            if isinstance(item, Refusal)
            else item[1:4]
        )
        total += sum(len(f) for f in fields)
    return total


def test_multi_megabyte_client_strings_are_cut_where_decisions_are_kept() -> None:
    """50 routed and 50 refused requests with 2 MB model names and request ids leave the ring
    holding under 100 KB of strings and its JSON under 100 KB; two different long names stay
    two names, one name always shows the same."""
    log = DecisionLog()
    parts = build_scheduling(
        None, settings=SchedulingSettings(), staleness_threshold=2.0, record=log.record
    )
    eps = [endpoint(), endpoint()]
    for i in range(50):
        name = f"{i:03d}" + "m" * HUGE
        request = replace(routed_request("r" * HUGE), model=name, target_model=name)
        parts.scheduler.schedule(request, eps)
        log.rejected("q" * HUGE, name, "", ErrorCode.NOT_FOUND, "x" * HUGE)
    assert held_characters(log) < 100_000
    shown_json = orjson.dumps(log.recent())
    assert len(shown_json) < 100_000
    newest, older = log.recent()[:2]
    assert newest["model"] == newest["targetModel"]
    assert newest["model"].startswith("049mmm")
    assert "characters in all" in newest["model"]
    assert newest["model"] != log.recent()[2]["model"]  # 049... and 048... stay distinct
    assert older["requestId"].startswith("rrr")
    assert len(older["requestId"]) < 300


def test_control_and_bidi_characters_are_shown_escaped() -> None:
    """A right-to-left override, a newline and a zero-width joiner in a model name and request
    id come out of the JSON as visible ``\\u`` escapes, in the order they were sent."""
    log = DecisionLog()
    log.rejected("id\n2", "evil\u202egpj.exe\u200d", "", ErrorCode.NOT_FOUND, "no \u2066x")
    (refusal,) = log.recent()
    assert refusal["model"] == "evil\\u202egpj.exe\\u200d"
    assert refusal["targetModel"] == refusal["model"]
    assert refusal["requestId"] == "id\\u000a2"
    assert refusal["error"]["message"] == "no \\u2066x"
    assert all(c.isprintable() for c in orjson.dumps(refusal).decode())
