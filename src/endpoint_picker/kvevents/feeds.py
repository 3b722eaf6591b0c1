"""What the KV-events hub is configured with, reports to, and keeps per publisher: its config,
its observer (the EPP's metrics), each publisher's stream state with the counts the status page
shows, and the pod an llm-d topic names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """How the hub reaches the publishers (the scorer's ``kvEventsConfig``)."""

    port: int = 5557  # each pod's publisher port (connect mode), llm-d's socketPort
    bind_endpoint: str = ""  # zmqEndpoint: bind here instead, every pod connects (bind mode)
    replay_port: int = 0  # each pod's replay ROUTER port; 0: none (a gap drops the view)
    topic_filter: str = ""  # ZeroMQ prefix filter on topics; vLLM's default topic is ""
    max_message_bytes: int = 16 << 20  # a bigger message is refused by ZeroMQ (MAXMSGSIZE)
    dead_after: float = 30.0  # connect mode: blocks of a publisher gone this long are dropped
    silence_timeout: float = 0.0  # blocks of a pod silent this long are dropped; 0: never
    replay_timeout: float = 2.0  # seconds for a whole replay answer
    max_replay_messages: int = 10_000  # vLLM buffers 10,000 steps by default
    sweep_interval: float = 1.0  # seconds between checks for dead and silent publishers


@runtime_checkable
class KVEventsObserver(Protocol):
    """What the hub reports; the EPP's Prometheus metrics implement it."""

    def kv_events_received(self, events: int) -> None: ...

    def kv_events_error(self, kind: str) -> None: ...

    def kv_events_gap(self, repaired: bool) -> None: ...

    def track_kv_index(self, size: Callable[[], float], endpoints: Callable[[], float]) -> None: ...


class Feed:
    """One publisher's stream state, and its counts for the status page."""

    __slots__ = (
        "connected",
        "dup_floor",
        "events",
        "last_at",
        "last_message_at",
        "last_seq",
        "rebuilds",
        "replays",
        "since",
    )

    def __init__(self, now: float) -> None:
        self.last_seq: int | None = None
        self.dup_floor: int | None = None  # replayed from here: lower numbers are restarts
        self.last_at = now  # last message (or the subscription's start)
        self.last_message_at: float | None = None  # None: nothing received yet
        self.connected = False
        self.since = now  # when ``connected`` last changed
        self.events = 0  # events applied (replayed ones included)
        self.replays = 0  # gaps repaired by the replay socket
        self.rebuilds = 0  # views dropped to rebuild: a gap unrepaired, a bad batch, a restart


def topic_pod(topic: str) -> str | None:
    """The pod IP of an llm-d topic ``kv@<pod-ip>@<model>``, else None."""
    parts = topic.split("@")
    return parts[1] if len(parts) == 3 and parts[0] == "kv" and parts[1] else None


def feed_state(feed: Feed | None, config: KVEventsConfig, now: float) -> str:
    """``waiting`` (nothing received yet), ``live``, ``disconnected`` (connect mode, for less
    than ``deadAfter``), ``dead`` (longer: its blocks no longer count) or ``silent`` (nothing
    for ``silenceTimeout``: likewise), as the hub's sweep judges them."""
    if feed is None or feed.last_message_at is None:
        return "waiting"
    if not config.bind_endpoint and not feed.connected:
        return "dead" if now - feed.since > config.dead_after else "disconnected"
    if config.silence_timeout > 0 and now - feed.last_at > config.silence_timeout:
        return "silent"
    return "live"
