"""Prompt text of exact token lengths from a seeded corpus, and the streaming request bodies."""

from __future__ import annotations

import random

import pytest

from endpoint_picker.bench.prompts import TextSource, chat_body, completion_body
from endpoint_picker_sim.tokenizer import count_tokens


@pytest.mark.parametrize("tokens", [1, 5, 50, 2000, 40_000])
def test_text_has_exact_token_length(tokens: int) -> None:
    """A text of n tokens is 4n ASCII characters (the simulator's count), head first."""
    text = TextSource(random.Random(1)).text("Head 1: ", tokens)
    assert len(text) == 4 * tokens
    assert count_tokens(text) == tokens
    assert text.startswith("Head 1: "[: 4 * tokens])
    assert text.isascii()


def test_text_is_seeded() -> None:
    """The same seed gives the same texts and tags; another seed gives others."""
    a, b, c = (TextSource(random.Random(s)) for s in (4, 4, 5))
    assert [a.text("x", 100), a.tag()] == [b.text("x", 100), b.tag()]
    assert a.text("x", 100) != c.text("x", 100)


def test_text_reads_as_words() -> None:
    """After the head the text starts at a word of the corpus, not inside one."""
    source = TextSource(random.Random(2))
    for _ in range(50):
        body = source.text("H: ", 30)[3:]
        assert body[0] != " "
        assert body.split(" ")[0].isalpha()


def test_completion_body_streams_exactly_max_tokens() -> None:
    """A completion body streams with usage and asks for exactly max_tokens (ignore_eos)."""
    body = completion_body("m", "hello", 7)
    assert body == {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    assert body["stream_options"] is not completion_body("m", "x", 1)["stream_options"]


def test_chat_body_names_the_user() -> None:
    """A chat body carries the messages and the session id in OpenAI's user field."""
    messages = [{"role": "user", "content": "hi"}]
    body = chat_body("m", messages, 3, "session-1")
    assert body["messages"] is messages
    assert body["user"] == "session-1"
    assert body["max_tokens"] == 3
    assert body["stream"] is True
    assert body["ignore_eos"] is True
