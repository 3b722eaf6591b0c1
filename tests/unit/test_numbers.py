"""Numbers a client, a server or a file wrote are read as ASCII digits only, within a maximum."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from endpoint_picker.admission import client_timeout as _client_timeout
from endpoint_picker.envoy_config import EnvoyConfigError, parse_endpoint
from endpoint_picker.errors import ConfigError
from endpoint_picker.flags.values import non_negative as _non_negative
from endpoint_picker.flags.values import port as _port
from endpoint_picker.flags.values import workers as _workers
from endpoint_picker.scheduling.plugins.session import session_token, token_endpoint
from endpoint_picker.types import ascii_int, parse_hostport

# isdigit() passes the first two and int() refuses them; int() reads the rest as numbers
NOT_ASCII_NUMBERS = ["²", "1²", "٣٠٠", "３", "+5", "-5", " 5", "5 ", "1_000", "0x10", "", "9" * 20]


@pytest.mark.parametrize("text", NOT_ASCII_NUMBERS)
def test_only_ascii_digits_are_a_number(text: str) -> None:
    """Superscripts, other scripts' digits, signs, spaces, underscores: not a number."""
    assert ascii_int(text, 10**30) is None


@pytest.mark.parametrize(("text", "maximum", "value"), [
    ("0", 5, 0), ("007", 10, 7), ("65535", 65535, 65535), ("65536", 65535, None),
])  # fmt: skip
def test_ascii_numbers_up_to_the_maximum(text: str, maximum: int, value: int | None) -> None:
    assert ascii_int(text, maximum) == value


@pytest.mark.parametrize("text", ["²", "٣٠٠", "1_000", " 300"])
def test_an_odd_expected_timeout_header_shortens_nothing(text: str) -> None:
    """``x-envoy-expected-rq-timeout-ms: ²`` (a 500 before) or Arabic-Indic digits: ignored."""
    assert _client_timeout(text) is None
    assert _client_timeout("300") == 0.3
    assert _client_timeout(str(10**12)) is None  # past a day: the band's TTL stands


READERS: list[tuple[Callable[[str], object], type[Exception], str]] = [
    (parse_hostport, ValueError, "127.0.0.1:{}"),
    (parse_hostport, ValueError, "[::1]:{}"),
    (parse_endpoint, EnvoyConfigError, "10.0.0.5:{}"),
    (_port, ConfigError, "{}"),
    (_non_negative, ConfigError, "{}"),
    (_workers, ConfigError, "{}"),
]


@pytest.mark.parametrize(("reader", "error", "template"), READERS)
@pytest.mark.parametrize("number", ["²", "٨٠", "8_0", "+80", "99999"])
def test_every_reader_refuses_what_is_not_an_ascii_number(
    reader: Callable[[str], object], error: type[Exception], template: str, number: str
) -> None:
    """Ports and counts from pool files, subset hints, flags: a clear error, never a crash
    (``²`` raised ValueError from int() in parse_endpoint) nor another script's digits."""
    if number == "99999" and reader in (_non_negative, _workers):
        return  # a fine count
    with pytest.raises(error):
        reader(template.format(number))


def test_a_session_token_with_other_digits_names_no_endpoint() -> None:
    assert token_endpoint(session_token("127.0.0.1:٨٠٠٠")) is None
    assert token_endpoint(session_token("127.0.0.1:8000")) == "127.0.0.1:8000"
