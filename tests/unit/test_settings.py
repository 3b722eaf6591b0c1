"""Go-style durations and booleans; flags that reach the settings."""

from __future__ import annotations

import pytest

from endpoint_picker.cli import build_parser, settings_from_args
from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import parse_bool, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("50ms", 0.05), ("2s", 2.0), ("1m30s", 90.0), ("0", 0.0), ("1.5h", 5400.0), ("250us", 2.5e-4)],
)
def test_durations(text: str, seconds: float) -> None:
    """Go duration strings parse to seconds."""
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "5x", "ms", "1s2"])
def test_bad_durations(text: str) -> None:
    """Durations without units or with junk are rejected."""
    with pytest.raises(ConfigError):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "value"), [("true", True), ("FALSE", False), ("1", True), ("f", False)]
)
def test_booleans(text: str, value: bool) -> None:
    """Booleans parse like Go's ParseBool."""
    assert parse_bool(text) is value


def test_bad_boolean() -> None:
    """A non-boolean is a clear error."""
    with pytest.raises(ConfigError, match="invalid boolean"):
        parse_bool("maybe")


@pytest.mark.parametrize(
    ("flags", "seconds"), [([], 0.5), (["--pool-file-settle-time", "2s"], 2.0)]
)
def test_pool_file_settle_time_flag(flags: list[str], seconds: float) -> None:
    """--pool-file-settle-time reaches PoolSettings; half a second by default."""
    args = build_parser().parse_args(["serve", "--pool-file", "pool.yaml", *flags])
    assert settings_from_args(args).pool.reload_settle_time == seconds
