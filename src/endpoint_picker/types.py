"""Core value types shared by every layer: endpoints, criticality, metrics snapshots, the
subset hint."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class Criticality(StrEnum):
    """How important a request is (seed 004); only Sheddable requests are ever shed."""

    CRITICAL = "Critical"
    STANDARD = "Standard"
    SHEDDABLE = "Sheddable"


MAX_PORT = 65535


def ascii_int(text: str, maximum: int) -> int | None:
    """``text`` as a whole number when it is 1 to 19 ASCII digits and at most ``maximum``;
    None otherwise. The one way the EPP reads a number a client, a server or a file wrote:
    ``str.isdigit`` passes ``²`` (which ``int`` refuses) and ``int`` reads other scripts'
    digits (``٣`` is 3), signs, spaces and ``_``, and refuses 4,300 digits with ValueError."""
    if not 0 < len(text) <= 19 or not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if value <= maximum else None


def _port(text: str, whole: str) -> int:
    port = ascii_int(text, MAX_PORT)
    if port is None:
        raise ValueError(f"bad port in {whole!r}")
    return port


def format_hostport(address: str, port: int) -> str:
    """``ip:port``; IPv6 addresses are bracketed (``[::1]:8000``)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def parse_hostport(text: str) -> tuple[str, int | None]:
    """Parse ``ip:port``, ``[v6]:port``, a bare ``ip`` or a bare IPv6 address.

    Returns the canonical address and the port (``None`` when absent; ASCII digits, at most
    65535). Raises ``ValueError``.
    """
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"unbalanced bracket in {text!r}")
        port = _port(rest[1:], text) if rest.startswith(":") else None
        if rest and port is None:
            raise ValueError(f"bad port in {text!r}")
        return str(ipaddress.IPv6Address(host)), port
    if text.count(":") == 1:
        host, _, port_text = text.partition(":")
        return str(ipaddress.IPv4Address(host)), _port(port_text, text)
    return str(ipaddress.ip_address(text)), None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model-server endpoint: a port of a Ready pod in the pool."""

    pod_name: str
    namespace: str
    address: str
    port: int
    labels: tuple[tuple[str, str], ...] = ()
    hostport: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hostport", format_hostport(self.address, self.port))

    def label(self, key: str, default: str = "") -> str:
        for k, v in self.labels:
            if k == key:
                return v
        return default


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """What the scheduler knows of one endpoint, as of ``updated_at`` (monotonic seconds).

    ``updated_at == 0`` means never scraped. Swapped in whole, never mutated.
    ``max_active_adapters is None``: the server has reported no LoRA info (vLLM sets that gauge
    as it schedules, so a fresh pod may have none yet; servers without LoRA never do): no
    adapter is known to be loaded, and its free slots are unknown. ``base_models``: the model
    names its metrics are labelled with (vLLM's ``model_name``): its base model, never an
    adapter.
    """

    waiting_queue_size: int = 0
    running_requests: int = 0
    kv_cache_usage: float = 0.0
    active_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_active_adapters: int | None = None
    base_models: frozenset[str] = frozenset()
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    updated_at: float = 0.0


EMPTY_METRICS = MetricsSnapshot()


@dataclass(frozen=True, slots=True)
class EndpointState:
    """An endpoint with its metrics as of one moment: what scheduling plugins read."""

    endpoint: Endpoint
    metrics: MetricsSnapshot

    @property
    def hostport(self) -> str:
        return self.endpoint.hostport


@dataclass(frozen=True, slots=True)
class SubsetHint:
    """The endpoints Envoy's subset hint allows a request (``envoy.lb.subset_hint``): entries
    name an address (any port of it) or an address and port; ``malformed`` keeps the entries
    that are neither, which the director ignores (and logs)."""

    hosts: frozenset[str]
    hostports: frozenset[tuple[str, int]]
    malformed: tuple[str, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> SubsetHint:
        hosts: set[str] = set()
        hostports: set[tuple[str, int]] = set()
        malformed: list[str] = []
        for entry in entries:
            try:
                host, port = parse_hostport(entry)
            except ValueError:
                malformed.append(entry)
                continue
            if port is None:
                hosts.add(host)
            else:
                hostports.add((host, port))
        return cls(frozenset(hosts), frozenset(hostports), tuple(malformed))

    def select(self, states: Iterable[EndpointState]) -> tuple[EndpointState, ...]:
        """The states the hint names, in their order."""
        hosts, hostports = self.hosts, self.hostports
        return tuple(
            s
            for s in states
            if s.endpoint.address in hosts or (s.endpoint.address, s.endpoint.port) in hostports
        )


@dataclass(frozen=True, slots=True)
class AccessDecision:
    """What an authorizer of the metrics port says of one request (a token and a path).

    ``status`` is the HTTP answer: 200 allowed, 401 no or bad token, 403 a known user without
    the permission. ``user`` names the token's owner when it is known (for logs, never the
    token); ``reason`` is a short text for the client and the logs.
    """

    status: int
    reason: str = ""
    user: str = ""

    @property
    def allowed(self) -> bool:
        return self.status == 200


def is_base_model(model: str, endpoints: Sequence[EndpointState]) -> bool:
    """``model`` is a candidate's base model and no candidate's adapter.

    Checked across candidates, not per endpoint: an endpoint not scraped yet knows no base
    model, and must not be told apart from the others for it.
    """
    if not any(model in e.metrics.base_models for e in endpoints):
        return False
    return not any(
        model in m.active_adapters or model in m.waiting_adapters
        for e in endpoints
        for m in (e.metrics,)
    )
