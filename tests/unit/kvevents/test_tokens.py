"""Prompts as the model server tokenizes them: chat requests through the chat template, a
completion's prompt as it is, token-id prompts as they are; no tokens where none can be found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from tests.support.kvevents import build_tokenizer
from tokenizers import Tokenizer

from endpoint_picker.errors import ConfigError
from endpoint_picker.kvevents.tokens import PromptTokenizer, load_tokenizer, load_tokenizers
from endpoint_picker.requests import Api, parse_request


def request(api: Api, body: dict[str, Any], model: str = "m"):  # type: ignore[no-untyped-def]
    return parse_request("r1", api, orjson.dumps({"model": model, **body}))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok")).parent


def test_chat_requests_go_through_the_chat_template(tokenizer_dir: Path) -> None:
    """The rendered template (bos, roles, generation prompt) is what gets tokenized."""
    prompts = PromptTokenizer(load_tokenizers((("m", tokenizer_dir),)))
    messages = [{"role": "system", "content": "the quick fox"}, {"role": "user", "content": "dog"}]
    tokens = prompts.tokens(request(Api.CHAT_COMPLETIONS, {"messages": messages}))
    raw = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    text = "<s><|system|>the quick fox<|end|><|user|>dog<|end|><|assistant|>"
    assert tokens is not None
    assert list(tokens) == raw.encode(text, add_special_tokens=False).ids
    no_prompt = prompts.tokens(
        request(Api.CHAT_COMPLETIONS, {"messages": messages, "add_generation_prompt": False})
    )
    assert no_prompt is not None
    assert list(no_prompt) == list(tokens)[:-1]


def test_completions_are_tokenized_as_they_are(tokenizer_dir: Path) -> None:
    """A string prompt is encoded as the server would; a token-id prompt is taken whole."""
    prompts = PromptTokenizer(load_tokenizers((("", tokenizer_dir),)))  # pool-wide
    raw = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokens = prompts.tokens(request(Api.COMPLETIONS, {"prompt": "lazy dog jumps"}, "any"))
    assert tokens is not None
    assert list(tokens) == raw.encode("lazy dog jumps").ids
    ids = prompts.tokens(request(Api.COMPLETIONS, {"prompt": [5, 6, 7]}))
    assert ids is not None
    assert list(ids) == [5, 6, 7]


def test_no_tokens_without_a_tokenizer_or_a_single_prompt(tokenizer_dir: Path) -> None:
    """Another model, a batch of prompts, embeddings: no key and no tokens (the scorer gives 0)."""
    prompts = PromptTokenizer(load_tokenizers((("m", tokenizer_dir),)))
    other = request(Api.COMPLETIONS, {"prompt": "dog"}, "other")
    batch = request(Api.COMPLETIONS, {"prompt": ["a", "b"]})
    embed = request(Api.EMBEDDINGS, {"input": "dog"})
    for r in (other, batch, embed):
        assert prompts.key(r) is None
    assert prompts.tokens(other) is None
    assert prompts.tokens(embed) is None


def test_keys_depend_on_what_decides_the_tokens_only(tokenizer_dir: Path) -> None:
    """Sampling parameters do not change the key; the messages and the model do."""
    prompts = PromptTokenizer(load_tokenizers((("", tokenizer_dir),)))
    messages = [{"role": "user", "content": "dog"}]
    a = prompts.key(request(Api.CHAT_COMPLETIONS, {"messages": messages, "temperature": 0}))
    b = prompts.key(request(Api.CHAT_COMPLETIONS, {"messages": messages, "max_tokens": 5}))
    c = prompts.key(request(Api.CHAT_COMPLETIONS, {"messages": messages}, "other"))
    d = prompts.key(request(Api.CHAT_COMPLETIONS, {"messages": [*messages, *messages]}))
    assert a == b
    assert len({a, c, d}) == 3


def test_a_failing_template_gives_no_tokens(tmp_path: Path) -> None:
    """raise_exception in a template (a bad role order, say) is no tokens, not a crash."""
    path = build_tokenizer(tmp_path, chat_template="{{ raise_exception('roles must alternate') }}")
    prompts = PromptTokenizer({"m": load_tokenizer(path)})
    chat = request(Api.CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "x"}]})
    assert prompts.tokens(chat) is None


def test_a_bad_tokenizer_file_is_a_config_error(tmp_path: Path) -> None:
    """A file that is not a tokenizer fails the start, naming the file."""
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
