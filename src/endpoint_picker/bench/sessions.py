"""The ``chat`` workload: multi-turn conversations whose context grows turn by turn.

Each session is one user talking to the model through ``/v1/chat/completions``. Turn ``k``'s
messages are turn ``k-1``'s, then the assistant's reply to it, then the user's new message, so
every turn's prompt starts with the whole previous prompt and its reply: the KV blocks of the
previous turn (the simulator caches the reply's blocks too) are reusable, but only on the server
that served it. That is what session-aware routing exploits and round robin wastes.

The replies are not known when the plan is made, so each assistant message holds
``model.ASSISTANT_PLACEHOLDER`` and a turn's ``follows`` is the index of the session's previous
turn. The client fills the placeholders in order with the replies along the ``follows`` chain
(the last one is the previous turn's reply) in a copy of the body: the plan is shared by every
target of a run and must stay unchanged. Each turn carries the session id in the
``x-session-id`` header and in the body's ``user`` field (what OpenAI clients send).

Timing. The client sends a request at its ``at`` and cannot send turn ``k`` before turn ``k-1``
has answered, so think time is modelled as a fixed gap between turns' ``at``:
``turn_gap = think_time + 0.5 s + 0.02 s x output_tokens``, the think time plus an allowance
for the reply (0.5 s to the first token, 20 ms per token: a moderately loaded server). When a
reply takes longer than its allowance, the next turn goes out as soon as it arrives (the
client's rule), so an overloaded target sees its chat traffic slow down, as with real users.

Sessions start as the run's arrival process at ``rate / turns`` sessions per second, so turns
arrive at ``rate`` on average. So that the load is steady from the first second rather than
ramping up over a session's length, sessions are started from ``-(turns - 1) x turn_gap``: one
started before 0 joins at its first turn at or after 0, as a fresh conversation with the turns
it has left. Turns due at or after ``duration`` are not sent.
"""

from __future__ import annotations

import math
from typing import Any

from endpoint_picker.bench.builders import CHAT_COMPLETIONS, Built, Context
from endpoint_picker.bench.model import ASSISTANT_PLACEHOLDER, RequestSpec
from endpoint_picker.bench.prompts import chat_body

SESSION_HEADER = "x-session-id"
REPLY_FIRST_TOKEN_S = 0.5
REPLY_SECONDS_PER_TOKEN = 0.02


def turn_gap(think_time: float, output_tokens: int) -> float:
    """Seconds between two turns' ``at``: think time plus the reply's allowance."""
    return think_time + REPLY_FIRST_TOKEN_S + REPLY_SECONDS_PER_TOKEN * output_tokens


def chat(ctx: Context) -> Built:
    turns = ctx.integer("turns")
    output_tokens = ctx.integer("output_tokens")
    user_tokens = ctx.integer("user_tokens")
    system_tokens = ctx.integer("system_tokens")
    gap = turn_gap(ctx.values["think_time"], output_tokens)
    lead = (turns - 1) * gap
    starts = ctx.arrivals(ctx.rate / turns, -lead, ctx.duration + lead)
    # One system prompt for every session, as one chat application has: the first turns of all
    # sessions share it, the trap of piling every new session onto the server that holds it.
    system = ctx.text.text(f"System prompt ({ctx.text.tag()}). ", system_tokens)
    out: list[RequestSpec] = []
    for n, start in enumerate(starts):
        first = 0 if start >= 0 else math.ceil(-start / gap)
        if start + first * gap < 0:  # rounding
            first += 1
        sid = f"session-{n}-{ctx.text.tag()}"
        headers = {SESSION_HEADER: sid}
        messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        previous: int | None = None
        for turn in range(turns - first):
            at = start + (first + turn) * gap
            if at >= ctx.duration:
                break
            user = {"role": "user", "content": ctx.text.text(f"{sid} turn {turn}: ", user_tokens)}
            if previous is None:
                messages = [*messages, user]
            else:
                # Fresh dicts per turn: no two bodies share a mutable part.
                reply = {"role": "assistant", "content": ASSISTANT_PLACEHOLDER}
                messages = [dict(m) for m in messages] + [reply, user]
            body: dict[str, Any] = chat_body(ctx.base_model, messages, output_tokens, sid)
            out.append(RequestSpec(len(out), at, CHAT_COMPLETIONS, body, dict(headers), group=sid,
                                   turn=turn, follows=previous,
                                   expected_output_tokens=output_tokens))  # fmt: skip
            previous = len(out) - 1
    return Built(out)
