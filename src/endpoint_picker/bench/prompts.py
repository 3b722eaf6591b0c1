"""Prompt text and request bodies for the workloads: seeded, sized in tokens, cheap to make.

The simulator counts one token per 4 characters (``endpoint_picker_sim.tokenizer``), so a text
of ``n`` tokens is exactly ``4 n`` characters of ASCII; real tokenizers land near that for English
words, which is what the text is made of. All text is sliced from one seeded corpus of words
built once per plan, so a 60 s run at 50 requests/s with 2,000-token system prompts takes
milliseconds: a group's system prompt is built once and the same string object is reused, and
each request adds only its short question.

Every piece starts with a head that names it (``System prompt 3 (1f2e…)``, ``Question 812:``):
two groups differ from their first characters, hence from their first 16-token KV block, so no
prefix cache (the simulator's chained block hashes, a router's prefix index) can confuse them.
"""

from __future__ import annotations

import random
from typing import Any

CHARS_PER_TOKEN = 4

_WORDS = """the of and to in is that for it as was with be by on not he this are or his from at
which but have an they you were her she there been one all we their has would when if so no will
more can its who about out into than them only other new some could time these two may first
then do any like my now over such our man me even most made after also did many before must
through back years where much your way well down should because each just those people how
too little state good very make world still own see men work long here get both between life
being under never day same another know while last might us great old year off come since
against go came right used take three cache route server model token query answer request
latency queue prefix session adapter budget cluster gateway"""
_VOCAB = tuple(_WORDS.split())
_CORPUS_WORDS = 16_384  # ~90,000 characters: longer than any default prompt, so slices rarely wrap


class TextSource:
    """Seeded filler text of an exact length, as slices of one corpus."""

    __slots__ = ("_corpus", "_doubled", "_rng")

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._corpus = " ".join(rng.choices(_VOCAB, k=_CORPUS_WORDS)) + " "
        # Doubled so a slice that runs off the end wraps without a second concatenation.
        self._doubled = self._corpus + self._corpus

    def tag(self) -> str:
        """A short random hex tag: makes texts differ between seeds, not only between pieces."""
        return f"{self._rng.getrandbits(32):08x}"

    def text(self, head: str, tokens: int) -> str:
        """``head`` followed by corpus text, ``tokens`` tokens (``4 * tokens`` characters) long."""
        chars = tokens * CHARS_PER_TOKEN
        need = chars - len(head)
        if need <= 0:
            return head[:chars]
        size = len(self._corpus)
        # Start at a word, so the text reads as words (the corpus ends with a space: found).
        offset = self._doubled.index(" ", self._rng.randrange(size)) + 1
        if offset + need <= len(self._doubled):
            return head + self._doubled[offset : offset + need]
        reps = -(-(offset + need) // size)  # a prompt longer than the corpus: rare, so built here
        return head + (self._corpus * reps)[offset : offset + need]


def _common(model: str, max_tokens: int) -> dict[str, Any]:
    # ``max_tokens`` alone fixes the output length in the simulator (it has no EOS: every
    # request runs to max_tokens); ``ignore_eos`` (a vLLM extension) does the same on a real
    # vLLM so its figures compare. A fresh ``stream_options`` per body: no shared mutable parts.
    return {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streaming ``/v1/completions`` body."""
    body = _common(model, max_tokens)
    body["prompt"] = prompt
    return body


def chat_body(
    model: str, messages: list[dict[str, str]], max_tokens: int, user: str
) -> dict[str, Any]:
    """A streaming ``/v1/chat/completions`` body; ``user`` is the OpenAI end-user id field."""
    body = _common(model, max_tokens)
    body["messages"] = messages
    body["user"] = user
    return body
