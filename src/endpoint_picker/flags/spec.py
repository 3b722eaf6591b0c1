"""A flag declared once: argparse reads it, the settings receive it, ``docs/flags.md`` shows it.

A ``Flag`` names the settings field its value lands in (``"server.grpc_port"``); its default is
that field's default unless it says otherwise, so a default lives in ``settings.py`` alone. From
a table of flags this module builds the parser's arguments (``add_groups``), the ``Settings``
from the parsed flags (``build_settings``) and the markdown reference (``markdown``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, is_dataclass, replace
from typing import Any, Literal

from endpoint_picker.flags.values import BOOL, DURATION
from endpoint_picker.settings import Settings

# value: `--x V`; switch: bare, true when given; optional: `--x`, `--x=V` or `--x V` (bare is
# true, as Go's boolean flags); repeat: each `--x V` adds one value to a list
Kind = Literal["value", "switch", "optional", "repeat"]


README = "../README.md"  # docs/flags.md's links to the README's sections


class _FromField:
    def __repr__(self) -> str:
        return "FROM_FIELD"


FROM_FIELD: Any = _FromField()  # Flag.default: the settings field's default (over Flag.unit)


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag. Help texts are plain; ``doc`` and ``shown`` are markdown."""

    name: str  # "--grpc-port"
    # Where the value lands in Settings, dotted ("server.grpc_port"); None: read by another
    # flag's `derive`. A flag not given (value None) leaves the field at its default.
    field: str | None
    help: str  # --help's text (default appended)
    doc: str = ""  # docs/flags.md's meaning where it says more than the help
    read: Callable[[str], Any] | None = None  # text -> value (argparse's type=)
    metavar: str = ""
    choices: tuple[str, ...] = ()
    kind: Kind = "value"
    default: Any = FROM_FIELD
    shown: str = ""  # the default as --help and the doc say it; "": the default formatted
    unit: int = 1  # the field holds the flag's number times this (a KiB flag, a bytes field)
    store: Callable[[Any], Any] | None = None  # the flag's value -> the field's
    derive: Callable[[argparse.Namespace], Any] | None = None  # the field's value from all flags

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


Groups = Sequence[tuple[str, Sequence[Flag]]]  # (title, flags): --help's sections, the doc's


def default_of(flag: Flag) -> Any:
    """The value argparse gives the flag when it is not on the command line."""
    if flag.default is not FROM_FIELD:
        return flag.default
    if flag.field is None:
        raise ValueError(f"{flag.name}: a flag without a field needs a default")
    value: Any = Settings()
    for name in flag.field.split("."):
        value = getattr(value, name)
    return value // flag.unit if flag.unit != 1 else value


def format_duration(seconds: float) -> str:
    """Seconds the way the flags take them: ``50ms``, ``30s``, ``5m``, ``1m30s``."""
    if seconds == 0:
        return "0"
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    parts = (f"{hours:g}h" if hours else "", f"{minutes:g}m" if minutes else "")
    return "".join(parts) + (f"{secs:g}s" if secs else "")


def shown_default(flag: Flag) -> str:
    """The default as ``--help`` and ``docs/flags.md`` show it (markdown)."""
    if flag.shown:
        return flag.shown
    if flag.kind == "switch":
        return "off"
    value = default_of(flag)
    if value is None or value == []:
        return "none"
    if flag.read is DURATION:
        return format_duration(value)
    if flag.read is BOOL:
        return "true" if value else "false"
    return str(value)


def invocation(flag: Flag) -> str:
    """How the flag is written: ``--grpc-port PORT``, ``--metrics-endpoint-auth[=BOOL]``."""
    metavar = flag.metavar or "|".join(flag.choices) or flag.dest.upper()
    if flag.kind == "switch":
        return flag.name
    if flag.kind == "optional":
        return f"{flag.name}[={metavar}]"
    return f"{flag.name} {metavar}"


def _plain(markdown: str) -> str:
    return markdown.replace("`", "")


def add_arguments(parser: argparse._ActionsContainer, flags: Iterable[Flag]) -> None:
    """The flags as argparse arguments, each help ending with its default."""
    for flag in flags:
        text = f"{flag.help} (default: {_plain(shown_default(flag))})"
        kwargs: dict[str, Any] = {"help": text.replace("%", "%%")}  # argparse %-formats help
        if flag.kind == "switch":
            parser.add_argument(flag.name, action="store_true", **kwargs)
            continue
        kwargs.update(type=flag.read, default=default_of(flag), metavar=flag.metavar or None)
        if flag.choices:
            kwargs["choices"] = flag.choices
        if flag.kind == "optional":
            kwargs.update(nargs="?", const=True)
        elif flag.kind == "repeat":
            kwargs["action"] = "append"
        parser.add_argument(flag.name, **kwargs)


def add_groups(parser: argparse.ArgumentParser, groups: Groups) -> None:
    for title, flags in groups:
        add_arguments(parser.add_argument_group(title), flags)


def build_settings(args: argparse.Namespace, flags: Iterable[Flag]) -> Settings:
    """``Settings()`` with every given flag's value in its field. A deeper field is filled after
    a shallower one, so that it refines it (one engine's metric inside all the overrides)."""
    tree: dict[str, Any] = {}
    bound = [flag for flag in flags if flag.field is not None]
    for flag in sorted(bound, key=lambda flag: str(flag.field).count(".")):
        value = flag.derive(args) if flag.derive else getattr(args, flag.dest)
        if flag.store is not None:
            value = flag.store(value)
        if value is None:
            continue
        _put(tree, str(flag.field).split("."), value * flag.unit if flag.unit != 1 else value)
    built: Settings = _replaced(Settings(), tree)
    return built


def _put(tree: dict[str, Any], path: list[str], value: Any) -> None:
    *parents, last = path
    for name in parents:
        child = tree.get(name)
        child = dict(child) if isinstance(child, dict) else {}  # a copy: never edit a value
        tree[name] = child
        tree = child
    tree[last] = value


def _replaced(default: Any, tree: dict[str, Any]) -> Any:
    """``default`` with ``tree``'s values; a dict for a nested dataclass is applied inside it."""
    changes = {}
    for name, value in tree.items():
        current = getattr(default, name)
        nested = is_dataclass(current) and isinstance(value, dict)
        changes[name] = _replaced(current, value) if nested else value
    return replace(default, **changes)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(groups: Groups) -> str:
    """One table per group: flag, default, meaning."""
    lines: list[str] = []
    for title, flags in groups:
        lines += [f"## {title}", "", "| flag | default | meaning |", "|---|---|---|"]
        for flag in flags:
            cells = (f"`{invocation(flag)}`", shown_default(flag), flag.doc or flag.help)
            lines.append("| " + " | ".join(map(_cell, cells)) + " |")
        lines.append("")
    return "\n".join(lines)
