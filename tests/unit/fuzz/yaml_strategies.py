"""Hypothesis strategies for YAML configuration documents: random trees, mutations of the
shipped examples, and scalars written as raw YAML text that PyYAML types on its own."""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from endpoint_picker.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[3] / "deploy" / "examples"

# Scalars PyYAML gives a type (date, timestamp, int, bool, float) but cannot build: every
# loader of ours answers them with a ConfigError, never a crash.
UNBUILDABLE_SCALARS = (
    "2024-13-45",
    "2001-12-14t21:59:43.10+99:00",
    "9" * 5000,
    "!!bool maybe",
    "!!int ''",
    "!!timestamp foo",
    "!!float .",
)

# Python values YAML can carry, with the types a config field may get wrong.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63, max_value=10**400)
    | st.floats()  # NaN and the infinities included
    | st.text(max_size=12)
    | st.sampled_from(["", "0", "-1", "30s", "0s", "1Gi", "-5ms", "Critical", "flowControl"])
    | st.datetimes(timezones=st.none() | st.just(datetime.UTC))
    | st.dates()
    | st.binary(max_size=4)
)


def trees(keys: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """Nested mappings and lists over ``SCALARS``, keyed mostly by ``keys``."""
    return st.recursive(
        SCALARS,
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(keys | st.text(max_size=6) | st.integers(), children, max_size=4)
        ),
        max_leaves=16,
    )


# Plain scalars PyYAML resolves to a type by their look, some of which it cannot build
# (a 13th month, an offset past a day, more digits than int() reads), and explicit tags.
RAW_SCALARS = st.sampled_from(
    [
        "2024-13-45",
        "2024-02-30",
        "0000-01-01",
        "2001-12-14t21:59:43.10+99:00",
        "2001-12-14 21:59:43.10 -5",
        "9" * 5000,
        "'" + "9" * 5000 + "'",
        "'" + "9" * 5000 + "Mi'",
        "-" + "1" * 4400,
        "0x" + "f" * 5000,
        "1e400",
        ".nan",
        "-.inf",
        "190:20:30",
        "0o777",
        "0b1010",
        "1_000",
        "~",
        "yes",
        "!!timestamp foo",
        "!!bool maybe",
        "!!int ''",
        "!!int abc",
        "!!float ''",
        "!!float .",
        "!!binary '###'",
        "!!set [1]",
        "!!python/object:os.system x",
        "&a [*a]",
        "*undefined",
        "{<<: 1}",
        "[[[[[[[[",
        "'unterminated",
        '"\\x"',
        "\t",
        "? [1]",
        "|",
        "- a",
    ]
)


def mutate(doc: Any, data: st.DataObject, keys: st.SearchStrategy[str]) -> Any:
    """``doc`` with one change at a random spot: a key dropped, a value replaced by another
    type, or an unknown key added."""
    doc = copy.deepcopy(doc)
    parent: Any = None
    slot: Any = None
    node = doc
    while isinstance(node, dict | list) and node and data.draw(st.integers(0, 3)) > 0:
        slot = data.draw(
            st.sampled_from(list(node) if isinstance(node, dict) else range(len(node)))
        )
        parent, node = node, node[slot]
    action = data.draw(st.sampled_from(["drop", "replace", "add"]))
    if action == "add" and isinstance(node, dict):
        node[data.draw(keys | st.text(max_size=6))] = data.draw(trees(keys))
    elif action == "drop" and parent is not None:
        del parent[slot]
    elif parent is not None:
        parent[slot] = data.draw(trees(keys))
    else:
        return data.draw(trees(keys))
    return doc


def raw_scalar_in(text: str, data: st.DataObject) -> str:
    """``text`` with one ``key: value`` line's value replaced by a raw YAML scalar."""
    lines = text.splitlines()
    spots = [
        i for i, line in enumerate(lines) if ": " in line and not line.lstrip().startswith("#")
    ]
    if not spots:
        return text
    i = data.draw(st.sampled_from(spots))
    key = lines[i].split(": ", 1)[0]
    lines[i] = f"{key}: {data.draw(RAW_SCALARS)}"
    return "\n".join(lines) + "\n"


def dump(docs: list[Any]) -> str:
    return yaml.safe_dump_all(docs, allow_unicode=True, sort_keys=False)


def config_error(load: Callable[[], object]) -> ConfigError | None:
    """The ``ConfigError`` ``load`` raises, or None; any other exception fails the test."""
    try:
        load()
    except ConfigError as exc:
        return exc
    return None
