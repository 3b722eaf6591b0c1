"""The inputs of ``epp envoy-config``, checked and spelled as YAML: ports, addresses,
durations, file paths, pool endpoints; the variants, the defaults and the one error."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from endpoint_picker.errors import ConfigError
from endpoint_picker.types import ascii_int

VARIANTS = ("reference", "fallback", "buffered")

# deploy/envoy/templates/ in a source checkout (src/endpoint_picker/envoy_config/ -> repo).
DEFAULT_TEMPLATE_DIR = Path(__file__).resolve().parents[3] / "deploy" / "envoy" / "templates"

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_MESSAGE_TIMEOUT = 10.0
DEFAULT_STREAM_IDLE_TIMEOUT = 600.0
DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_NUM_RETRIES = 2
# Above the EPP's --max-request-headers (100, Envoy's own default): the EPP answers 431 before
# its header mutation could push a request past Envoy's limit (see docs/envoy.md).
DEFAULT_MAX_HEADERS_COUNT = 120
# Routed to the pool besides /v1/completions (whose route the others reuse); the EPP answers
# /v1/models and /health (the gateway's own health: a pod's is never reached) itself.
# Everything else is a 404 at Envoy: a model server's admin API stays shut.
DEFAULT_INFERENCE_PATHS = ("/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


class EnvoyConfigError(ConfigError, ValueError):
    """An input cannot be rendered into a valid configuration (one line, for the CLI)."""


def valid_duration(seconds: float, name: str) -> str:
    """Seconds as a protobuf JSON duration: ``10s``, ``0.25s``, ``0s``."""
    if seconds < 0:
        raise EnvoyConfigError(f"{name} must not be negative: {seconds}")
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return f"{text}s"


def valid_port(value: int, name: str) -> str:
    if not 0 < value < 65536:
        raise EnvoyConfigError(f"{name} must be a port in 1..65535: {value}")
    return str(value)


def valid_address(value: str, name: str) -> str:
    """An IP address or a DNS name (validated here so nothing odd lands in the YAML)."""
    if is_ip(value) or _HOSTNAME.fullmatch(value):
        return value
    raise EnvoyConfigError(f"{name} is not an IP address or host name: {value!r}")


def is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def parse_endpoint(text: str) -> tuple[str, int]:
    """``10.0.0.5:8000`` or ``[fd00::5]:8000`` -> (ip, port); pool endpoints are IPs."""
    host, sep, port_text = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    number = ascii_int(port_text, 10**19)  # any digits: a port out of range is said as such
    if not sep or number is None or not is_ip(host):
        raise EnvoyConfigError(f"endpoint must be ip:port: {text!r}")
    valid_port(number, f"endpoint {text!r} port")
    return host, number


def quote(value: str) -> str:
    """A YAML double-quoted scalar (for IPv6 addresses and the like)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def valid_file(path: str, name: str) -> str:
    """A file path as Envoy will open it (not read here: it is a path in Envoy's filesystem)."""
    if not path.strip() or any(not c.isprintable() for c in path):
        raise EnvoyConfigError(f"{name} is not a usable file path: {path!r}")
    return f"{{ filename: {quote(path)} }}"
