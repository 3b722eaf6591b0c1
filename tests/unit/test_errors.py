"""The helpers every client string goes through before the EPP keeps or shows it."""

from __future__ import annotations

from endpoint_picker.errors import CLIP_CHARS, kept, shown


def test_kept_cuts_long_values_and_keeps_them_distinct_and_stable() -> None:
    """Short values stay whole (same object); long ones are cut to about CLIP_CHARS with a
    digest of the whole, so equal values give equal keys and different ones different keys."""
    short = "llama-3.1-8b"
    assert kept(short) is short
    a, b = "x" * 10**6 + "a", "x" * 10**6 + "b"
    assert len(kept(a)) < CLIP_CHARS + 80
    assert kept(a) == kept("x" * 10**6 + "a")
    assert kept(a) != kept(b)


def test_shown_escapes_controls_bidi_and_backslashes_only() -> None:
    """Printable text is returned as is; controls, bidi overrides and isolates, zero-width
    characters and astral format characters come out as escapes, a backslash doubled."""
    plain = "modèle/日本語 v2"
    assert shown(plain) is plain
    assert shown("a\u202eb\u2066c\u200bd\x00e\\f\U000e0001") == (
        "a\\u202eb\\u2066c\\u200bd\\u0000e\\\\f\\U000e0001"
    )


def test_every_error_the_package_raises_on_purpose_is_in_the_tree() -> None:
    """The errors outside errors.py (Envoy config rendering, the worker channel, `epp bench`)
    are EppErrors, so one ``except EppError`` catches everything raised on purpose; the Envoy
    config error stays a ValueError and is a ConfigError (bad input to a command: exit 2)."""
    from endpoint_picker.bench.model import BenchError
    from endpoint_picker.envoy_config import EnvoyConfigError
    from endpoint_picker.errors import ConfigError, EppError
    from endpoint_picker.workers.messages import ChannelClosed

    for error in (EnvoyConfigError("bad port"), ChannelClosed("eof", eof=True), BenchError("no")):
        assert isinstance(error, EppError), type(error).__name__
    assert isinstance(EnvoyConfigError("x"), ConfigError)
    assert isinstance(EnvoyConfigError("x"), ValueError)
    assert str(EnvoyConfigError("listen port must be 1..65535")) == "listen port must be 1..65535"
    closed = ChannelClosed("worker gone", eof=True)
    assert (str(closed), closed.eof) == ("worker gone", True)
