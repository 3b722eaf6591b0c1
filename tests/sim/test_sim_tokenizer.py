"""The approximate tokenizer: counts, generated text, chained block hashes, chat template."""

from __future__ import annotations

import pytest

from endpoint_picker_sim.tokenizer import (
    block_hashes,
    count_tokens,
    generate_text,
    render_chat,
    tokenize_ids,
    tokenize_text,
)


@pytest.mark.parametrize(
    ("text", "tokens"), [("", 0), ("a", 1), ("abcd", 1), ("abcde", 2), ("x" * 400, 100)]
)
def test_count_is_ceil_of_quarter_length(text: str, tokens: int) -> None:
    """One token per four characters, rounded up."""
    assert count_tokens(text) == tokens


@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 16), (7, 100), (47, 3), (1000, 257)])
def test_generated_text_has_exact_token_count(start: int, n: int) -> None:
    """Generated text re-tokenises to exactly the number of tokens asked for."""
    assert count_tokens(generate_text(start, n)) == n


def test_generated_text_is_deterministic_and_continues() -> None:
    """Chunks generated from successive offsets concatenate to the text generated at once."""
    whole = generate_text(0, 30)
    assert generate_text(0, 30) == whole
    assert generate_text(0, 10) + generate_text(10, 20) == whole


def test_block_hashes_cover_only_full_blocks() -> None:
    """A 16-token block is 64 characters; a partial tail block gets no hash."""
    assert len(block_hashes("x" * 63, 16, None)) == 0
    assert len(block_hashes("x" * 64 * 3 + "tail", 16, None)) == 3


def test_block_hashes_are_chained() -> None:
    """Equal prefixes share hashes; after the first differing block, every hash differs."""
    a = "A" * 64 + "B" * 64 + "C" * 64
    b = "A" * 64 + "X" * 64 + "C" * 64
    ha, hb = block_hashes(a, 16, None), block_hashes(b, 16, None)
    assert ha[0] == hb[0]
    assert ha[1] != hb[1]
    assert ha[2] != hb[2]  # same block text, different parent


def test_lora_name_seeds_the_chain() -> None:
    """The same text under an adapter hashes differently from the base model."""
    text = "hello " * 50
    assert block_hashes(text, 16, None)[0] != block_hashes(text, 16, "sql-lora")[0]
    assert block_hashes(text, 16, "a") == block_hashes(text, 16, "a")


def test_token_id_prompts() -> None:
    """Token-id prompts count one token per id and hash per block of ids."""
    tok = tokenize_ids(list(range(40)), 16, None)
    assert tok.num_tokens == 40
    assert len(tok.block_hashes) == 2
    assert tokenize_text("abcd" * 40, 16, None).num_tokens == 40


def test_chat_template_makes_next_turn_extend_the_previous() -> None:
    """A conversation's next turn starts with the previous turn's text, so its blocks hit."""
    turn1 = [("system", "You are helpful."), ("user", "Hi")]
    turn2 = [*turn1, ("assistant", "Hello!"), ("user", "More")]
    head = render_chat(turn1).removesuffix("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render_chat(turn2).startswith(head)
