"""The bench's tokenizer for the fleet and the EPP, built in-process."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer

from endpoint_picker.bench.prompts import TextSource
from endpoint_picker.bench.tokenizer import SPECIAL, build_tokenizer
from endpoint_picker_sim.tokenizer import generate_text, render_chat


def test_the_built_tokenizer_is_lossless_deterministic_and_knows_the_words(tmp_path: Path) -> None:
    """Any bench prompt round-trips, two builds are identical files, a prompt word and the
    simulator's reply words are single tokens, the template's markers are special tokens."""
    import random

    path = build_tokenizer(tmp_path / "a")
    assert build_tokenizer(tmp_path / "b").read_bytes() == path.read_bytes()
    tok = Tokenizer.from_file(str(path))
    text = TextSource(random.Random(3)).text("System prompt 3 (1f2e09ab). ", 300)
    assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode(" cache").ids) == 1
    reply = generate_text(0, 48)
    assert len(tok.encode(reply).ids) == 48
    for marker in SPECIAL:
        assert len(tok.encode(marker).ids) == 1


def test_the_chat_template_renders_as_the_simulator_does(tmp_path: Path) -> None:
    """tokenizer_config.json's chat_template renders messages to exactly the simulator's text,
    so the EPP and the fleet tokenize a chat request to the same ids."""
    build_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    rendered = (
        jinja2.Environment()
        .from_string(config["chat_template"])
        .render(messages=messages, bos_token=config["bos_token"], add_generation_prompt=True)
    )
    assert rendered == render_chat([(m["role"], m["content"]) for m in messages])
