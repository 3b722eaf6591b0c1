"""The chat workload: growing conversations, follows links, session ids, steady turn rate."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from endpoint_picker.bench.model import ASSISTANT_PLACEHOLDER, RequestSpec
from endpoint_picker.bench.sessions import SESSION_HEADER, turn_gap
from endpoint_picker.bench.workloads import generate

_SMALL = {"system_tokens": "40", "user_tokens": "10", "output_tokens": "20", "think_time": "1"}


def _sessions(duration: float = 60.0, **params: str) -> dict[str, list[RequestSpec]]:
    plan = generate("chat", rate=20.0, duration=duration, seed=11, params={**_SMALL, **params})
    sessions: dict[str, list[RequestSpec]] = defaultdict(list)
    for spec in plan.requests:
        sessions[spec.group].append(spec)
    return sessions


def test_each_turn_extends_the_previous_one() -> None:
    """Turn k's messages are turn k-1's plus the placeholder reply and a new user message."""
    sessions = _sessions()
    assert max(len(turns) for turns in sessions.values()) == 6  # the default turns
    for sid, turns in sessions.items():
        assert [t.turn for t in turns] == list(range(len(turns)))
        first = turns[0].body["messages"]
        assert [m["role"] for m in first] == ["system", "user"]
        assert turns[0].follows is None
        for prev, cur in itertools.pairwise(turns):
            msgs = cur.body["messages"]
            assert msgs[:-2] == prev.body["messages"]
            assert msgs[-2] == {"role": "assistant", "content": ASSISTANT_PLACEHOLDER}
            assert msgs[-1]["role"] == "user"
            assert msgs[-1]["content"].startswith(sid)
            assert cur.follows == prev.index
            assert prev.index < cur.index


def test_one_session_id_per_conversation() -> None:
    """Every turn carries its session's id in x-session-id and body.user, unique per session."""
    sessions = _sessions()
    for sid, turns in sessions.items():
        for spec in turns:
            assert spec.headers == {SESSION_HEADER: sid}
            assert spec.body["user"] == sid
            assert spec.path == "/v1/chat/completions"
            assert spec.body["max_tokens"] == 20
    assert len({t[0].body["messages"][1]["content"] for t in sessions.values()}) == len(sessions)


def test_turns_are_a_fixed_gap_apart() -> None:
    """Think time is a fixed gap in ``at``: think time plus the reply's allowance."""
    gap = turn_gap(1.0, 20)
    assert gap == pytest.approx(1.0 + 0.5 + 0.02 * 20)
    for turns in _sessions().values():
        for prev, cur in itertools.pairwise(turns):
            assert cur.at - prev.at == pytest.approx(gap)


def test_turn_rate_is_steady_from_the_start() -> None:
    """Sessions under way at 0 join mid-stream: the first and last thirds carry equal load."""
    specs = [s for turns in _sessions(duration=90.0).values() for s in turns]
    assert len(specs) == pytest.approx(20.0 * 90.0, rel=0.1)
    first = sum(1 for s in specs if s.at < 30.0)
    last = sum(1 for s in specs if s.at >= 60.0)
    assert first == pytest.approx(last, rel=0.15)
    assert all(0.0 <= s.at < 90.0 for s in specs)


def test_no_body_shares_a_mutable_part() -> None:
    """Message dicts are fresh per turn, so filling one body's placeholders touches no other."""
    seen: set[int] = set()
    for turns in _sessions().values():
        for spec in turns:
            ids = {id(m) for m in spec.body["messages"]} | {id(spec.body["messages"])}
            assert not ids & seen
            seen |= ids


def test_no_system_message_when_zero_tokens() -> None:
    """system_tokens=0 leaves the conversation without a system message."""
    turns = next(iter(_sessions(system_tokens="0").values()))
    assert turns[0].body["messages"][0]["role"] == "user"
