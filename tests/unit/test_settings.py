"""Go-style durations and booleans."""

from __future__ import annotations

import pytest

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
