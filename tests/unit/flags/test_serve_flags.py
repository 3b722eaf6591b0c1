"""`epp serve`'s flags come from one table: docs/flags.md, --help and the Settings agree."""

from __future__ import annotations

import argparse
import re
from dataclasses import is_dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from endpoint_picker.cli import build_parser, settings_from_args
from endpoint_picker.errors import ConfigError
from endpoint_picker.flags.serve import SERVE, reference
from endpoint_picker.flags.spec import Flag, format_duration
from endpoint_picker.flags.values import (
    BOOL,
    COUNT,
    DURATION,
    ENGINE_METRIC,
    INFERENCE_PATH,
    PERCENT,
    PORT,
    TOKENIZER,
    WORKERS,
)
from endpoint_picker.settings import (
    MetricsAuth,
    MetricsEndpointSettings,
    PoolSettings,
    ServerSettings,
    Settings,
)

DOC = Path(__file__).parents[3] / "docs" / "flags.md"
KUBERNETES = ["serve", "--pool-name", "p"]
FLAGS = [flag for _, flags in SERVE for flag in flags]


def test_docs_flags_md_is_what_the_table_generates() -> None:
    """docs/flags.md is regenerated from the flag table (`make flags-doc`) and committed."""
    assert DOC.read_text(encoding="utf-8") == reference(), "stale: run `make flags-doc`"


def _doc_rows() -> list[list[str]]:
    rows = [line for line in DOC.read_text(encoding="utf-8").splitlines() if line[:4] == "| `-"]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def _serve_parser() -> argparse.ArgumentParser:
    commands = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    parser: argparse.ArgumentParser = commands.choices["serve"]
    return parser


def test_the_doc_has_a_row_for_each_option_of_the_parser_with_the_help_default() -> None:
    """Every option of the real `epp serve` parser, in its order, is a row of docs/flags.md,
    and --help states the default the row states."""
    actions = [action for action in _serve_parser()._actions if action.dest != "help"]
    rows = _doc_rows()
    assert [row[0].strip("`").split()[0].split("[")[0] for row in rows] == [
        action.option_strings[0] for action in actions
    ]
    for action, (_, default, _) in zip(actions, rows, strict=True):
        assert action.help is not None
        shown = default.replace("`", "").replace("\\|", "|")
        assert action.help.replace("%%", "%").endswith(f"(default: {shown})"), action.dest


def test_no_flags_build_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags' defaults are the settings dataclasses' own: no flag, no change (but the
    pool, and metrics auth on where a Kubernetes API can check tokens)."""
    monkeypatch.delenv("NAMESPACE", raising=False)
    args = build_parser().parse_args(["serve", "--pool-file", "pool.yaml"])
    assert settings_from_args(args) == Settings(pool=PoolSettings(pool_file=Path("pool.yaml")))
    kubernetes = settings_from_args(build_parser().parse_args(KUBERNETES))
    auth = MetricsEndpointSettings(auth=MetricsAuth.KUBERNETES)
    assert kubernetes == Settings(
        server=ServerSettings(metrics_endpoint=auth), pool=PoolSettings(pool_name="p")
    )


# a value each reader accepts, and what it reads it as
SAMPLES: dict[Any, tuple[str, Any]] = {
    DURATION: ("7s", 7.0),
    PORT: ("7", 7),
    COUNT: ("123456789", 123456789),
    WORKERS: ("3", 3),
    PERCENT: ("7", 7),
    float: ("0.25", 0.25),
    Path: ("x", Path("x")),
    None: ("x", "x"),
    INFERENCE_PATH: ("/v1/x", ("/v1/x",)),
    ENGINE_METRIC: ("e.f=m", {"e": {"f": "m"}}),
    TOKENIZER: (__file__, (("", Path(__file__)),)),  # any existing file passes the reader
}
# flags that need another to be valid, or that change another field: (argv, field, value)
ALSO: dict[str, tuple[list[str], str, Any]] = {
    "--metrics-client-ca-file": (
        ["--metrics-cert-dir", "d"], "server.metrics_endpoint.cert_dir", Path("d")
    ),
    "--metrics-token-file": ([], "server.metrics_endpoint.auth", MetricsAuth.TOKEN_FILE),
    "--pool-file": ([], "server.metrics_endpoint.auth", MetricsAuth.OFF),  # no Kubernetes API
}  # fmt: skip


def _get(settings: Any, path: str) -> Any:
    for name in path.split("."):
        settings = settings.get(name, {}) if isinstance(settings, dict) else getattr(settings, name)
    return settings


def _with(settings: Any, path: str, value: Any) -> Any:
    """``settings`` with the field at ``path`` (through dataclasses and dicts) set to value."""
    name, _, rest = path.partition(".")
    new = _with(_get(settings, name), rest, value) if rest else value
    return replace(settings, **{name: new}) if is_dataclass(settings) else {**settings, name: new}


def _sample(flag: Flag, default: Any) -> tuple[list[str], Any]:
    if flag.kind == "switch":
        return [flag.name], True
    if flag.choices:
        choice = next(choice for choice in flag.choices if choice != default)
        return [flag.name, choice], choice
    if flag.read is BOOL:
        return [flag.name, "false" if default else "true"], not default
    text, value = SAMPLES[flag.read]
    return [flag.name, text], value * flag.unit if flag.unit != 1 else value


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.derive is None], ids=lambda f: f.name)
def test_each_flag_fills_its_field_and_nothing_else(flag: Flag) -> None:
    """A flag given alone changes exactly the settings field it names, to the value it read."""
    base = settings_from_args(build_parser().parse_args(KUBERNETES))
    assert flag.field is not None
    default = _get(base, flag.field)
    argv, value = _sample(flag, default)
    expected = _with(base, flag.field, value)
    also_argv, also_field, also_value = ALSO.get(flag.name, ([], "", None))
    if also_field:
        expected = _with(expected, also_field, also_value)
    settings = settings_from_args(build_parser().parse_args([*KUBERNETES, *argv, *also_argv]))
    assert settings == expected


def test_tokenizers_are_per_model_or_pool_wide_and_never_two_for_one() -> None:
    """--tokenizer MODEL=PATH and PATH read as (model, path), "" the whole pool; a second one
    for the same model, or a path with no tokenizer.json, is a usage error."""
    here = Path(__file__)
    argv = [*KUBERNETES, "--tokenizer", f"llama={here}", "--tokenizer", str(here)]
    settings = settings_from_args(build_parser().parse_args(argv))
    assert settings.scheduling.tokenizers == (("llama", here), ("", here))
    twice = build_parser().parse_args([*KUBERNETES, "--tokenizer", str(here), "--tokenizer",
                                       str(here)])  # fmt: skip
    with pytest.raises(ConfigError, match="two tokenizers for the whole pool"):
        settings_from_args(twice)
    with pytest.raises(SystemExit):
        build_parser().parse_args([*KUBERNETES, "--tokenizer", "m=/nonexistent/dir"])


def test_a_vllm_metric_flag_refines_the_engine_metric_overrides() -> None:
    """The reference's --total-queued-requests-metric wins over --engine-metric vllm.queue,
    and leaves the other overrides as given."""
    argv = [
        *KUBERNETES,
        *("--engine-metric", "vllm.queue=a", "--engine-metric", "sglang.queue=s"),
        *("--total-queued-requests-metric", "b", "--engine-metric", "vllm.running=r"),
    ]
    overrides = settings_from_args(build_parser().parse_args(argv)).scrape.metric_overrides
    assert overrides == {"vllm": {"queue": "b", "running": "r"}, "sglang": {"queue": "s"}}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0"), (0.05, "50ms"), (0.5, "500ms"), (1, "1s"), (30, "30s"), (300, "5m"),
     (90, "1m30s"), (3600, "1h"), (1.5, "1.5s")],
)  # fmt: skip
def test_durations_are_shown_as_the_flags_take_them(seconds: float, text: str) -> None:
    """Defaults in --help and the doc are Go-style durations, which parse back to themselves."""
    assert format_duration(seconds) == text
    assert DURATION(text) == pytest.approx(seconds)
