"""Property-based fuzzing of the traffic-split rewrite of a request body's ``model``."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from endpoint_picker.target_model import MAX_MODEL_SPLICES as _MAX_MODEL_SPLICES
from endpoint_picker.target_model import rewrite_model as _rewrite_model

MODEL_KEY = re.compile(rb'"model"\s*:')

# Keys that come close to "model" in the raw bytes: quotes and backslashes around it, case,
# and the key itself (in nested objects, where it must not be the one rewritten).
TRICKY_KEYS = st.sampled_from(
    ["model", '"model', 'model"', '"model"', "\\model", "model\\", "Model", "model ", "mod\nel"]
)
KEYS = TRICKY_KEYS | st.text(max_size=8)
# Strings that look like the JSON around a model key, to sit in values too.
TRICKY_TEXT = st.sampled_from(['"model":"x"', '\\"model\\": "y"', "model", '"', "\\", "\\u0022"])
TEXT = TRICKY_TEXT | st.text(max_size=16)
SCALARS = (
    st.none()
    | st.booleans()
    # past 64 bits orjson reads integers as floats; the rewrite must keep every digit
    | st.integers()
    | st.integers(min_value=2**63, max_value=10**40)
    | st.integers(min_value=-(10**40), max_value=-(2**63) - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(KEYS, children, max_size=3)
        | st.builds(lambda m, rest: {"model": m, **rest}, TEXT, st.dictionaries(KEYS, children))
    ),
    max_leaves=12,
)
JSON_WS = st.text(alphabet=" \t\r\n", max_size=3)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """An object with a top-level string ``model`` at any position, among any other keys,
    sometimes behind many nested objects that have a ``model`` of their own; and a different
    model to rewrite it to (the director rewrites only a model the split changed)."""
    others = draw(st.dictionaries(KEYS.filter(lambda k: k != "model"), JSON_VALUES, max_size=5))
    items = list(others.items())
    if draw(st.integers(0, 3)) == 0:
        nested = draw(st.lists(TEXT, min_size=1, max_size=24))
        items.insert(0, ("tools", [{"model": m} for m in nested]))
    model = draw(TEXT)
    items.insert(draw(st.integers(0, len(items))), ("model", model))
    return dict(items), draw(TEXT.filter(lambda target: target != model))


Serialiser = Callable[[dict[str, Any]], bytes]


@st.composite
def serialisers(draw: st.DrawFn) -> tuple[Serialiser, bool]:
    """A way to write JSON bytes, and whether it may spell a key with escapes."""
    kind = draw(st.sampled_from(["json", "orjson", "escaping"]))
    if kind == "json":
        item_sep = draw(JSON_WS) + "," + draw(JSON_WS)
        key_sep = draw(JSON_WS) + ":" + draw(JSON_WS)
        options: dict[str, Any] = {
            "ensure_ascii": draw(st.booleans()),
            "indent": draw(st.sampled_from([None, 0, 2, "\t", "\r\n "])),
            "sort_keys": draw(st.booleans()),
            "separators": (item_sep, key_sep),
        }
        lead, trail = draw(JSON_WS), draw(JSON_WS)
        return (lambda body: (lead + json.dumps(body, **options) + trail).encode()), False
    if kind == "orjson":
        option = draw(st.sampled_from([0, orjson.OPT_INDENT_2, orjson.OPT_SORT_KEYS]))

        def with_orjson(body: dict[str, Any]) -> bytes:
            try:
                return orjson.dumps(body, option=option)
            except TypeError:  # an integer past 64 bits: orjson cannot write it
                return json.dumps(body).encode()

        return with_orjson, False
    seed = draw(st.integers(0, 2**32 - 1))
    return (lambda body: escaping_dumps(body, random.Random(seed))), True


def escaping_dumps(value: Any, rng: random.Random) -> bytes:
    """JSON with characters (key characters included) escaped at random, and random spacing."""

    def ws() -> str:
        return rng.choice(["", "", " ", "\n", "\t ", "\r\n"])

    def string(text: str) -> str:
        out = []
        for char in text:
            code = ord(char)
            if char in '"\\' or code < 0x20 or rng.random() < 0.3:
                if code > 0xFFFF:
                    high, low = divmod(code - 0x10000, 0x400)
                    out.append(f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04X}")
                else:
                    out.append(rng.choice(["\\u{:04x}", "\\u{:04X}"]).format(code))
            elif char == "/" and rng.random() < 0.5:
                out.append("\\/")
            else:
                out.append(char)
        return '"' + "".join(out) + '"'

    def encode(item: Any) -> str:
        if isinstance(item, dict):
            pairs = [f"{ws()}{string(k)}{ws()}:{ws()}{encode(v)}{ws()}" for k, v in item.items()]
            return "{" + ",".join(pairs) + ws() + "}"
        if isinstance(item, list):
            return "[" + ",".join(ws() + encode(v) + ws() for v in item) + ws() + "]"
        if isinstance(item, str):
            return string(item)
        return json.dumps(item)

    return (ws() + encode(value) + ws()).encode()


def splice_of(raw: bytes, out: bytes, old: str, new: str) -> bool:
    """Whether ``out`` is ``raw`` with one JSON string token meaning ``old`` replaced by
    orjson's ``new``, every other byte kept."""
    value = orjson.dumps(new)
    prefix = 0
    while prefix < min(len(raw), len(out)) and raw[prefix] == out[prefix]:
        prefix += 1
    for start in range(prefix, -1, -1):
        if out[start : start + len(value)] != value:
            continue
        rest = out[start + len(value) :]
        end = len(raw) - len(rest)
        if end > start and raw[end:] == rest and raw[:start] == out[:start]:
            token = raw[start:end]
            if token[:1] == token[-1:] == b'"' and json.loads(token) == old:
                return True
    return False


@given(bodies(), serialisers())
def test_rewrite_changes_only_the_model(
    case: tuple[dict[str, Any], str], serialiser: tuple[Serialiser, bool]
) -> None:
    """Only the top-level model changes; a plain key is spliced with every other byte kept."""
    body, target = case
    dumps, may_escape = serialiser
    raw = dumps(body)
    assert isinstance(orjson.loads(raw), dict)  # what parse_request accepts

    out = _rewrite_model(raw, target)

    # compared with the standard library, so integers past 64 bits compare digit for digit
    expected = {**json.loads(raw), "model": target}
    assert json.loads(out) == expected
    assert orjson.loads(out)["model"] == target
    spliced = splice_of(raw, out, body["model"], target)
    if not spliced:  # the one fallback: the standard library's compact re-serialisation
        assert out == json.dumps(expected, ensure_ascii=False, separators=(",", ":")).encode()
    if not may_escape and len(MODEL_KEY.findall(raw)) <= _MAX_MODEL_SPLICES:
        assert spliced


def test_many_nested_model_keys_parse_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: many nested "model" keys cost a bounded number of parses."""
    # each one cost a parse of the whole body: quadratic, 16,000 in 600 KB blocked the loop 51 s
    message = b'{"model":"x","content":"hello there"}'
    raw = b'{"messages":[' + b",".join([message] * 2_000) + b'],"model":"food-review"}'
    parses = 0
    loads = orjson.loads

    def counting_loads(data: bytes) -> Any:
        nonlocal parses
        parses += 1
        return loads(data)

    monkeypatch.setattr(orjson, "loads", counting_loads)
    out = _rewrite_model(raw, "food-review-v1")
    monkeypatch.undo()
    assert parses <= _MAX_MODEL_SPLICES
    assert json.loads(out) == {**json.loads(raw), "model": "food-review-v1"}


def test_model_key_behind_an_escaped_quote_is_not_spliced() -> None:
    """A key ending in "model" (``"\\"model"``) keeps its value; only the real key changes."""
    raw = b'{"\\"model": "m", "model": "m2"}'
    assert _rewrite_model(raw, "t") == b'{"\\"model": "m", "model": "t"}'
