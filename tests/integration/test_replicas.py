"""Two EPP replicas, started separately, agree on where new prefixes and sessions go."""

from __future__ import annotations

from pathlib import Path

from tests.support.extproc import body, headers, json_body, lb_metadata, make_settings, running_app
from tests.support.pool import model, pod, pool, pool_yaml

PODS = [pod(f"p{i}", f"127.0.9.{i + 2}") for i in range(6)]


async def test_separate_replicas_send_a_new_prefix_and_a_new_session_to_the_same_endpoint(
    tmp_path: Path,
) -> None:
    """Each replica learns only from its own decisions, yet both place every new prefix (and
    every new session) on the same endpoint, and different prefixes spread over the pool."""
    text = pool_yaml(pool(), model("m"), *PODS)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    async with (
        running_app(make_settings(tmp_path / "a", text)) as (_, first),
        running_app(make_settings(tmp_path / "b", text)) as (_, second),
    ):
        picks = set()
        for i in range(24):
            prompt = json_body({"model": "m", "prompt": f"You are assistant number {i}. " * 20})
            a = lb_metadata((await first.exchange([headers(), body(prompt)]))[0])
            b = lb_metadata((await second.exchange([headers(), body(prompt)]))[0])
            assert a == b, i
            picks.add(a)
            chat = json_body({"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]})
            session = {"x-session-id": f"conversation-{i}"}
            chat_headers = headers("/v1/chat/completions", extra=session)
            a = lb_metadata((await first.exchange([chat_headers, body(chat)]))[0])
            b = lb_metadata((await second.exchange([chat_headers, body(chat)]))[0])
            assert a, "not routed"
            assert a == b, i
        assert len(picks) >= 4
