"""Go-style durations and booleans; flags that reach the settings."""

from __future__ import annotations

import pytest

from endpoint_picker.cli import build_parser, settings_from_args
from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import MetricsAuth, OutlierSettings, parse_bool, parse_duration


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


KUBERNETES = ["serve", "--pool-name", "pool"]
POOL_FILE = ["serve", "--pool-file", "pool.yaml"]


@pytest.mark.parametrize(
    ("argv", "auth"),
    [
        (KUBERNETES, MetricsAuth.KUBERNETES),  # the reference's default: on
        ([*KUBERNETES, "--metrics-endpoint-auth"], MetricsAuth.KUBERNETES),  # Go's bare bool
        ([*KUBERNETES, "--metrics-endpoint-auth=true"], MetricsAuth.KUBERNETES),
        ([*KUBERNETES, "--metrics-endpoint-auth=false"], MetricsAuth.OFF),
        ([*KUBERNETES, "--metrics-endpoint-auth", "false"], MetricsAuth.OFF),
        ([*KUBERNETES, "--metrics-token-file", "t"], MetricsAuth.TOKEN_FILE),
        (POOL_FILE, MetricsAuth.OFF),  # the laptop path stays open
        ([*POOL_FILE, "--metrics-endpoint-auth=false"], MetricsAuth.OFF),
        ([*POOL_FILE, "--metrics-token-file", "t"], MetricsAuth.TOKEN_FILE),
        (
            [*POOL_FILE, "--metrics-token-file", "t", "--metrics-endpoint-auth"],
            MetricsAuth.TOKEN_FILE,
        ),
    ],
)
def test_metrics_endpoint_auth_defaults_to_on_only_with_kubernetes(
    argv: list[str], auth: MetricsAuth
) -> None:
    """--metrics-endpoint-auth: on by default with the Kubernetes source, off with a pool file;
    true/false in both Go spellings, bare means true; a token file selects static tokens."""
    settings = settings_from_args(build_parser().parse_args(argv))
    assert settings.server.metrics_endpoint.auth is auth


def test_metrics_tls_flags_reach_the_settings() -> None:
    """--metrics-cert-dir and --metrics-client-ca-file are kept as given."""
    argv = [*POOL_FILE, "--metrics-cert-dir", "certs", "--metrics-client-ca-file", "ca.crt"]
    endpoint = settings_from_args(build_parser().parse_args(argv)).server.metrics_endpoint
    assert (str(endpoint.cert_dir), str(endpoint.client_ca_file)) == ("certs", "ca.crt")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*POOL_FILE, "--metrics-endpoint-auth"], "needs --metrics-token-file"),
        (
            [*KUBERNETES, "--metrics-token-file", "t", "--metrics-endpoint-auth=false"],
            "drop --metrics-endpoint-auth=false",
        ),
        ([*POOL_FILE, "--metrics-client-ca-file", "ca.crt"], "needs --metrics-cert-dir"),
    ],
)
def test_contradictory_metrics_flags_are_refused(argv: list[str], message: str) -> None:
    """Auth asked for with nothing to check tokens with, a token file with auth off, or mutual
    TLS without TLS: a configuration error, never a port more open than asked."""
    with pytest.raises(ConfigError, match=message):
        settings_from_args(build_parser().parse_args(argv))


def test_outlier_flags_reach_the_settings_with_envoys_defaults() -> None:
    """The outlier-detection flags fill OutlierSettings; without them, Envoy's defaults (but
    half the pool, not a tenth); a percentage past 100 is a usage error."""
    base = ["serve", "--pool-file", "pool.yaml"]
    assert settings_from_args(build_parser().parse_args(base)).outliers == OutlierSettings(
        consecutive_failures=5,
        base_ejection_time=30.0,
        max_ejection_time=300.0,
        max_ejection_percent=50,
    )
    flags = [
        "--outlier-consecutive-failures=0",
        "--outlier-base-ejection-time=2s",
        "--outlier-max-ejection-time=1m",
        "--outlier-max-ejection-percent=10",
    ]
    outliers = settings_from_args(build_parser().parse_args([*base, *flags])).outliers
    assert outliers == OutlierSettings(0, 2.0, 60.0, 10)
    assert not outliers.enabled
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--outlier-max-ejection-percent=101"])
