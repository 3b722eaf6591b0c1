"""The ext_proc port's connection flags (GrpcConnectionSettings) reach the settings."""

from __future__ import annotations

import pytest

from endpoint_picker.cli import build_parser, settings_from_args
from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import GrpcConnectionSettings

POOL_FILE = ["serve", "--pool-file", "pool.yaml"]


def test_connection_flags_reach_the_settings_and_default_as_documented() -> None:
    """Each --grpc-* flag lands in ServerSettings.connections; without them, the defaults."""
    defaults = settings_from_args(build_parser().parse_args(POOL_FILE)).server.connections
    assert defaults == GrpcConnectionSettings()
    argv = [
        *POOL_FILE,
        *("--grpc-max-streams-per-connection", "500", "--grpc-keepalive-time", "1m"),
        *("--grpc-keepalive-timeout", "5s", "--grpc-max-connection-idle", "0"),
        *("--grpc-min-ping-interval", "10s", "--grpc-premature-reset-streams", "0"),
    ]
    connections = settings_from_args(build_parser().parse_args(argv)).server.connections
    assert connections == GrpcConnectionSettings(
        max_streams_per_connection=500,
        keepalive_time=60.0,
        keepalive_timeout=5.0,
        max_connection_idle=0.0,
        min_ping_interval=10.0,
        premature_reset_streams=0,
    )


def test_a_keepalive_without_a_timeout_is_refused() -> None:
    """A PING nobody waits for would close every connection at once: refused."""
    argv = [*POOL_FILE, "--grpc-keepalive-timeout", "0"]
    with pytest.raises(ConfigError, match="--grpc-keepalive-timeout"):
        settings_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize(
    ("per_connection", "process", "resolved"),
    [(0, 10_000, 20_000), (0, 0, 100_000), (0, 3, 6), (500, 10_000, 500)],
)
def test_the_stream_limit_per_connection_defaults_above_the_process_limit(
    per_connection: int, process: int, resolved: int
) -> None:
    """0 is twice --max-concurrent-streams (whose JSON 429 then comes first; Envoy does not keep
    to the announced limit), 100,000 without a process limit; a number is kept."""
    settings = GrpcConnectionSettings(max_streams_per_connection=per_connection)
    assert settings.resolved(process).max_streams_per_connection == resolved
