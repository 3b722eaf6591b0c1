"""A request's prompt as the model server will tokenize it, for the precise prefix scorer.

Each model (or the whole pool) has a Hugging Face ``tokenizer.json`` (``--tokenizer``); when a
``tokenizer_config.json`` beside it has a ``chat_template``, chat requests are rendered through
it first, as vLLM does (``add_generation_prompt`` true unless the request says otherwise, the
request's ``tools``, the tokenizer's ``bos_token`` and ``eos_token``), then tokenized without
adding special tokens (the template has them); a completion's ``prompt`` is tokenized as it is,
with them, and a prompt of token ids is taken as it is. A request of another kind (a batch of
prompts, embeddings) or a model without a tokenizer has no tokens: the scorer gives it 0.

Tokenizing is slow next to a pick (measured, docs/scheduling.md: an 8k-token prompt takes
tens of milliseconds here), so the tokens of recent prompts are kept, LRU, up to a number of
blocks in all (by the scorer); it tokenizes a short prompt inline and a long one on a thread.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from hashlib import blake2b
from pathlib import Path
from typing import Any

import orjson
import structlog
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from endpoint_picker.errors import ConfigError
from endpoint_picker.kvevents.prefixstore import Tokens, from_encoding
from endpoint_picker.kvevents.wire import TOKEN_ARRAY
from endpoint_picker.requests import Api, LLMRequest

log = structlog.get_logger(__name__)

POOL_WIDE = ""  # the model name of a tokenizer given for every model of the pool


@dataclass(frozen=True)
class ModelTokenizer:
    """One model's tokenizer and, when it has one, its chat template."""

    tokenizer: Tokenizer
    template: Any  # a jinja2 Template, or None without a chat template
    bos_token: str
    eos_token: str
    source: str

    def render(self, body: Mapping[str, Any]) -> str:
        """The chat request's prompt text, through the chat template."""
        return str(
            self.template.render(
                messages=body.get("messages"),
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        )

    def encode(self, text: str, special: bool, off_loop: bool = False) -> array[int]:
        """Token ids of ``text``. ``off_loop``: through ``encode_batch``, which lets go of the
        GIL while it works (``encode`` holds it: a thread encoding with it stalls the event
        loop all the same; measured in docs/scheduling.md)."""
        if off_loop:
            (encoding,) = self.tokenizer.encode_batch([text], add_special_tokens=special)
        else:
            encoding = self.tokenizer.encode(text, add_special_tokens=special)
        return array(TOKEN_ARRAY, encoding.ids)

    def encode_tokens(
        self, text: str, special: bool, off_loop: bool = False
    ) -> tuple[Tokens, array[int]]:
        """``text``'s tokens with their offsets, and the special tokens a post-processor
        appended after them (for the prefix store)."""
        if off_loop:
            (encoding,) = self.tokenizer.encode_batch([text], add_special_tokens=special)
        else:
            encoding = self.tokenizer.encode(text, add_special_tokens=special)
        return from_encoding(encoding, len(text))

    @cached_property
    def appended(self) -> array[int]:
        """The special tokens the tokenizer appends after a text (an EOS; usually none)."""
        return self.encode_tokens("a", special=True)[1]


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt text, the tokenizer it goes through and whether that adds special
    tokens (a completion's prompt: yes; a rendered chat template holds them already)."""

    model: ModelTokenizer
    text: str
    special: bool

    @property
    def root(self) -> str:
        """What the prefix store keys this prompt's chunks from."""
        return f"{self.model.source}\0{int(self.special)}"


def _raise(message: str) -> None:
    raise TemplateError(message)


def _special(config: Mapping[str, Any], name: str) -> str:
    value = config.get(name)
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else ""


def load_tokenizer(path: Path) -> ModelTokenizer:
    """``tokenizer.json`` (or a directory holding it), with the chat template of the
    ``tokenizer_config.json`` beside it; ``ConfigError`` when it cannot be loaded."""
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises its own Exception for a bad file
        raise ConfigError(f"cannot load a tokenizer: {exc}", str(file)) from exc
    config: dict[str, Any] = {}
    config_file = file.parent / "tokenizer_config.json"
    if config_file.is_file():
        try:
            loaded = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read: {exc}", str(config_file)) from exc
        if isinstance(loaded, dict):
            config = loaded
    template = None
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            template = env.from_string(source)
        except TemplateError as exc:
            raise ConfigError(f"chat_template: {exc}", str(config_file)) from exc
    return ModelTokenizer(
        tokenizer, template, _special(config, "bos_token"), _special(config, "eos_token"),
        str(file),
    )  # fmt: skip


def load_tokenizers(specs: tuple[tuple[str, Path], ...]) -> dict[str, ModelTokenizer]:
    """``--tokenizer`` values (model, path; model "" for the whole pool), loaded once each."""
    return {model: load_tokenizer(path) for model, path in specs}


class PromptTokenizer:
    """The tokens of a request's prompt, with the tokenizer of its target model.

    ``key`` digests what decides the tokens (the messages, tools and generation flag of a
    chat request, a completion's prompt, the API and the model), for a cache of results;
    ``tokens`` does the work and is safe to call on a thread.
    """

    __slots__ = ("_tokenizers",)

    def __init__(self, tokenizers: Mapping[str, ModelTokenizer]) -> None:
        self._tokenizers = dict(tokenizers)

    def __bool__(self) -> bool:
        return bool(self._tokenizers)

    def tokenizer(self, model: str) -> ModelTokenizer | None:
        return self._tokenizers.get(model) or self._tokenizers.get(POOL_WIDE)

    def key(self, request: LLMRequest) -> bytes | None:
        """What decides the request's tokens, digested; None when it has none to find."""
        body = request.body
        if request.api is Api.CHAT_COMPLETIONS:
            part: object = (body.get("messages"), body.get("tools"),
                            body.get("add_generation_prompt"))  # fmt: skip
        elif request.api is Api.COMPLETIONS:
            part = body.get("prompt")
            if not isinstance(part, str) and not _token_ids(part):
                return None  # a batch of prompts: which one would the server cache?
        else:
            return None
        if self.tokenizer(request.target_model) is None:
            return None
        try:
            raw = orjson.dumps(part)
        except TypeError:  # nested past orjson's limit: no tokens
            return None
        digest = blake2b(raw, digest_size=16)
        digest.update(b"\0" + request.api.value.encode() + b"\0")
        digest.update(request.target_model.encode("utf-8", "surrogatepass"))
        return digest.digest()

    def prompt(self, request: LLMRequest) -> Prompt | array[int] | None:
        """The text the server will tokenize (chat requests rendered through the template),
        or the prompt's token ids when it gives them; None when it has none to find."""
        model = self.tokenizer(request.target_model)
        if model is None:
            return None
        body = request.body
        if request.api is Api.COMPLETIONS:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return Prompt(model, prompt, special=True)
            ids = _token_ids(prompt)
            return array(TOKEN_ARRAY, ids) if ids else None
        if request.api is not Api.CHAT_COMPLETIONS:
            return None
        if model.template is None:
            # no chat template: the messages' contents in order, a rough stand-in
            text = "\n".join(
                str(m.get("content", "")) for m in body.get("messages") or () if isinstance(m, dict)
            )
            return Prompt(model, text, special=True)
        try:
            text = model.render(body)
        except (TemplateError, TypeError, ValueError) as exc:
            log.debug("chat template failed; no tokens", error=str(exc)[:200])
            return None
        return Prompt(model, text, special=False)

    def tokens(self, request: LLMRequest, off_loop: bool = False) -> array[int] | None:
        """The prompt's token ids; None when the request has none to find. ``off_loop``: on a
        thread beside the event loop (the encoder then lets go of the GIL)."""
        prompt = self.prompt(request)
        if prompt is None or isinstance(prompt, array):
            return prompt
        return prompt.model.encode(prompt.text, special=prompt.special, off_loop=off_loop)


def _token_ids(prompt: object) -> list[int] | None:
    """A prompt given as token ids (``[1, 2, 3]``), else None."""
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in prompt)
    ):
        return prompt
    return None
