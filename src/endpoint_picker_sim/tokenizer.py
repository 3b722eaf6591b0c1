"""A deterministic approximate tokenizer: one token per 4 characters, no model files.

Real BPE tokenizers average about 4 characters of English per token; what routing needs is that
token counts scale with text, that equal text prefixes give equal token prefixes, and that block
hashes for prefix caching can be computed without materialising token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CHARS_PER_TOKEN = 4

# Four-character words (leading space included), so generated text re-tokenises to its length.
_WORDS = (
    " the", " and", " for", " you", " are", " but", " not", " all", " can", " had",
    " her", " was", " one", " our", " out", " day", " get", " has", " him", " his",
    " how", " man", " new", " now", " old", " see", " two", " way", " who", " boy",
    " did", " its", " let", " put", " say", " she", " too", " use", " map", " key",
    " log", " row", " set", " sum", " top", " run", " big", " end",
)  # fmt: skip
_WORD_TEXT = "".join(_WORDS)
_PERIOD_TOKENS = len(_WORDS)


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """What the engine needs of a prompt: its length and the chained hash of each full block."""

    num_tokens: int
    block_hashes: tuple[int, ...]


def count_tokens(text: str) -> int:
    """Token count of ``text``: ceil(len/4)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def block_hashes(
    text: str, block_size: int, lora: str | None, max_blocks: int | None = None
) -> tuple[int, ...]:
    """Chained hashes of the full ``block_size``-token blocks of ``text``.

    Each hash covers the parent hash, so a block matches only after an identical prefix; the LoRA
    name seeds the chain because an adapter's KV differs from the base model's.
    """
    return extend_block_hashes(text, block_size, lora, (), max_blocks)


def extend_block_hashes(
    text: str,
    block_size: int,
    lora: str | None,
    known: tuple[int, ...],
    max_blocks: int | None = None,
) -> tuple[int, ...]:
    """Hashes of the full blocks of ``text`` after the ``known`` leading ones (which must be the
    hashes of ``text``'s first blocks): how a finished request's generated blocks get cached."""
    return _chain(text, block_size * CHARS_PER_TOKEN, lora, known, max_blocks)


def token_id_block_hashes(ids: Sequence[int], block_size: int, lora: str | None) -> tuple[int, ...]:
    """Chained block hashes for a prompt given as token ids."""
    return extend_id_hashes(ids, block_size, lora, ())


def extend_id_hashes(
    ids: Sequence[int],
    block_size: int,
    lora: str | None,
    known: tuple[int, ...],
    max_blocks: int | None = None,
) -> tuple[int, ...]:
    """Hashes of the full blocks of ``ids`` after the ``known`` leading ones, chained from them."""
    return _chain(tuple(ids), block_size, lora, known, max_blocks)


def _chain(
    units: str | tuple[int, ...],
    step: int,
    lora: str | None,
    known: tuple[int, ...],
    max_blocks: int | None,
) -> tuple[int, ...]:
    """The chained hashes of the full ``step``-unit blocks of ``units`` (characters or token ids;
    a slice of either is hashable) after the ``known`` ones, at most ``max_blocks`` in all."""
    full = len(units) // step
    if max_blocks is not None:
        full = min(full, max_blocks)
    parent = known[-1] if known else hash(("sim-root", lora))
    out: list[int] = []
    for i in range(len(known), full):
        parent = hash((parent, units[i * step : (i + 1) * step]))
        out.append(parent)
    return tuple(out)


def tokenize_text(text: str, block_size: int, lora: str | None) -> TokenizedPrompt:
    """Length and block hashes of a text prompt."""
    return TokenizedPrompt(count_tokens(text), block_hashes(text, block_size, lora))


def tokenize_ids(ids: Sequence[int], block_size: int, lora: str | None) -> TokenizedPrompt:
    """Length and block hashes of a prompt given as token ids."""
    return TokenizedPrompt(len(ids), token_id_block_hashes(ids, block_size, lora))


def generate_text(start: int, num_tokens: int) -> str:
    """Deterministic text of exactly ``num_tokens`` tokens, continuing from token ``start``."""
    if num_tokens <= 0:
        return ""
    begin = (start % _PERIOD_TOKENS) * CHARS_PER_TOKEN
    length = num_tokens * CHARS_PER_TOKEN
    reps = -(-(begin + length) // len(_WORD_TEXT))
    return (_WORD_TEXT * reps)[begin : begin + length]


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    """Render chat messages with a Llama-3-style template and the assistant header.

    The template matters for prefix caching: a conversation's next turn starts with exactly the
    text of the previous turn, so its blocks hash the same.
    """
    parts = ["<|begin_of_text|>"]
    for role, content in messages:
        parts.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>")
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)
