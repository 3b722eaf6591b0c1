"""The h2 server's checks of its clients: grpc-timeout, content-type, ping strikes, resets."""

from __future__ import annotations

import pytest

from endpoint_picker.extproc.h2policy import (
    MAX_PING_STRIKES,
    ContentType,
    PingPolicy,
    ResetPolicy,
    content_type_kind,
    parse_grpc_timeout,
)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(b"1H", 3600.0), (b"2M", 120.0), (b"3S", 3.0), (b"200m", 0.2), (b"7u", 7e-6),
     (b"99999999n", 0.099999999), (b"0S", 0.0)],
)  # fmt: skip
def test_grpc_timeouts_in_every_unit(value: bytes, seconds: float) -> None:
    """Every unit of the gRPC spec, up to 8 digits."""
    assert parse_grpc_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value", [b"", b"5", b"S", b"123456789S", b"1s", b"-1S", b"1.5S", b" 1S", "٣S".encode()]
)
def test_malformed_grpc_timeouts_are_refused(value: bytes) -> None:
    """No unit, a wrong unit, 9 digits, a sign, a fraction, a space or a non-ASCII digit."""
    with pytest.raises(ValueError, match="grpc-timeout"):
        parse_grpc_timeout(value)


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (b"application/grpc", ContentType.GRPC),
        (b"application/grpc+proto", ContentType.GRPC),
        (b"Application/GRPC; charset=utf-8", ContentType.GRPC),
        (b"application/grpc+json", ContentType.OTHER_CODEC),
        (b"application/grpcXYZ", ContentType.NOT_GRPC),
        (b"application/grpc-web", ContentType.NOT_GRPC),
        (b"application/json", ContentType.NOT_GRPC),
        (b"", ContentType.NOT_GRPC),
    ],
)
def test_content_types(value: bytes, kind: ContentType) -> None:
    """gRPC's content-type exactly, a codec suffix or MIME parameters, nothing that only
    starts like it."""
    assert content_type_kind(value) is kind


def test_ping_strikes_count_only_pings_too_soon_and_reset_with_data() -> None:
    """Paced pings never strike; the third strike past the limit is one too many, unless data
    went by (reset) in between."""
    policy = PingPolicy(min_interval=1.0)
    assert not any(policy.received(float(t)) for t in range(10))  # one a second: fine
    verdicts = [policy.received(9 + 0.01 * i) for i in range(1, MAX_PING_STRIKES + 2)]
    assert verdicts == [False] * MAX_PING_STRIKES + [True]
    policy.reset()
    assert not policy.received(11.0)
    assert PingPolicy(min_interval=0.0).received(0.0) is False


def test_premature_resets_are_judged_as_envoy_does() -> None:
    """Half the limit of premature resets trips it early on; past the limit, half of all
    streams opened; old or answered streams never count; limit 0 turns it off."""
    policy = ResetPolicy(limit=10)
    policy.opened = 4
    assert [policy.reset(0.1) for _ in range(5)] == [False] * 4 + [True]
    policy = ResetPolicy(limit=10)
    policy.opened = 100
    assert not any(policy.reset(0.1) for _ in range(49))
    assert policy.reset(0.1)
    old = ResetPolicy(limit=2)
    assert not any(old.reset(1.5) for _ in range(10))  # older than a second
    assert not ResetPolicy(limit=0).reset(0.0)
