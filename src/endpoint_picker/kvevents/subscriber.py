"""Subscribing to every endpoint's KV-cache events, and keeping the index in step with them.

Two socket modes, as vLLM's publisher offers (its endpoint binds when it has a wildcard, else
connects):

- **connect** (the default): each pod's vLLM binds ``tcp://*:<port>``; the hub keeps one SUB
  socket connected to ``tcp://<pod-ip>:<port>`` per pod of the pool, opened when the pod joins
  and closed, its blocks dropped, when it leaves (``set_endpoints``, called on every pool
  change). ZeroMQ reconnects by itself; a socket monitor tells when the publisher is gone, and
  one gone longer than ``dead_after`` has its blocks dropped.
- **bind** (``zmqEndpoint``, llm-d's central mode): the hub binds one SUB socket and every pod
  connects to it, publishing on the topic ``kv@<pod-ip>@<model>``; the pod is the topic's IP
  (messages from an IP not in the pool are ignored).

Each publisher numbers its messages from 0. A gap (a message lost to a full queue, a dropped
connection) is repaired by asking the publisher's replay socket (``replay_port``,
``kvevents.replay``) or, without one, by dropping that pod's view and rebuilding it from the
events that follow.
The first message from a pod asks the replay socket for everything from 0 (what the publisher
still buffers); a sequence number that goes back means the publisher restarted (an empty cache).
A message that does not decode is logged and counted and treated as a gap. With
``silence_timeout``, a pod that sent nothing that long has its blocks dropped too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from endpoint_picker.errors import KVEventsError, clip
from endpoint_picker.kvevents.feeds import (
    Feed,
    KVEventsConfig,
    KVEventsObserver,
    feed_state,
    topic_pod,
)
from endpoint_picker.kvevents.index import BlockIndex
from endpoint_picker.kvevents.replay import Replay
from endpoint_picker.kvevents.wire import Message, decode_batch, split_frames
from endpoint_picker.types import Endpoint

log = structlog.get_logger(__name__)

MESSAGES_PER_TURN = 64  # messages handled before the loop is let go for other work


class KVEventsHub:
    """The subscriptions, one feed state per pod, and the index they keep up to date."""

    def __init__(
        self,
        config: KVEventsConfig,
        index: BlockIndex,
        *,
        observer: object | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.index = index
        self._observer = observer if isinstance(observer, KVEventsObserver) else None
        if self._observer is not None:
            self._observer.track_kv_index(
                lambda: float(index.size), lambda: float(len(index.endpoints))
            )
        self._clock = clock
        self._pods: frozenset[str] = frozenset()
        self._feeds: dict[str, Feed] = {}
        self._subscriptions: dict[str, asyncio.Task[None]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._changed = asyncio.Event()
        self.bound_port = 0  # bind mode: the port bound (tests bind port 0)
        # the models prompts are tokenized for ("" for all), told at start: without any, the
        # scorer scores 0 however many events arrive
        self.tokenized_models: tuple[str, ...] = ()

    @property
    def bind_mode(self) -> bool:
        return bool(self.config.bind_endpoint)

    def describe(self, pod: str) -> dict[str, Any] | None:
        """The status page's view of ``pod``'s subscription (None: not a pod of the pool).
        Constant time: the index counts each endpoint's blocks as it goes."""
        if pod not in self._pods:
            return None
        feed = self._feeds.get(pod)
        last = feed.last_message_at if feed is not None else None
        return {
            "state": feed_state(feed, self.config, self._clock()),
            "blocks": self.index.blocks_of(pod),
            "events": feed.events if feed is not None else 0,
            "replays": feed.replays if feed is not None else 0,
            "rebuilds": feed.rebuilds if feed is not None else 0,
            "lastEventAgeSeconds": round(self._clock() - last, 3) if last is not None else None,
        }

    # -- the pool -----------------------------------------------------------------------------

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """The pool changed: pods that left lose their subscription and their blocks."""
        pods = frozenset(e.address for e in endpoints)
        for gone in self._pods - pods:
            self._feeds.pop(gone, None)
            self.index.drop(gone)
        self._pods = pods
        self._changed.set()

    # -- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe, follow the pool, sweep dead publishers; until cancelled."""
        self._ctx = zmq.asyncio.Context()
        if not self.tokenized_models:
            log.warning("precise-prefix-cache-scorer has no tokenizer (--tokenizer): it scores 0")
        tasks: list[asyncio.Task[None]] = []
        try:
            if self.bind_mode:
                tasks.append(asyncio.create_task(self._bound(), name="kv-events-bind"))
            tasks.append(asyncio.create_task(self._sweep(), name="kv-events-sweep"))
            while True:
                if not self.bind_mode:
                    self._follow_pool()
                self._changed.clear()
                await self._changed.wait()
        finally:
            for task in [*tasks, *self._subscriptions.values()]:
                task.cancel()
            await asyncio.gather(*tasks, *self._subscriptions.values(), return_exceptions=True)
            self._subscriptions.clear()
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _follow_pool(self) -> None:
        for pod in list(self._subscriptions):
            if pod not in self._pods:
                self._subscriptions.pop(pod).cancel()
        for pod in self._pods - self._subscriptions.keys():
            self._subscriptions[pod] = asyncio.create_task(
                self._subscribe(pod), name=f"kv-events-{pod}"
            )

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5_000)
        return sock

    async def _subscribe(self, pod: str) -> None:
        """Connect mode: one pod's SUB socket and its monitor, until the pod leaves."""
        host = f"[{pod}]" if ":" in pod else pod
        url = f"tcp://{host}:{self.config.port}"
        sock = self._socket(zmq.SUB)
        if ":" in pod:
            sock.setsockopt(zmq.IPV6, 1)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        watch = asyncio.create_task(
            self._watch(pod, monitor, sock, url), name=f"kv-events-monitor-{pod}"
        )
        try:
            sock.connect(url)
            sock.setsockopt(zmq.SUBSCRIBE, self.config.topic_filter.encode())
            log.info("subscribed to KV events", endpoint=url)
            while True:
                for _ in range(MESSAGES_PER_TURN):
                    frames = await sock.recv_multipart(copy=True)
                    await self._on_frames(pod, frames)
                    if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        break
                await asyncio.sleep(0)  # a busy publisher lets the picks in between
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    async def _watch(
        self, pod: str, monitor: zmq.asyncio.Socket, sock: zmq.asyncio.Socket, url: str
    ) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            connected = event["event"] == zmq.EVENT_CONNECTED
            if not connected:
                # ZeroMQ reconnects after a lost connection, but not after one it dropped
                # for a protocol error (a message past maxMessageBytes): connect again
                with contextlib.suppress(zmq.ZMQError):
                    sock.disconnect(url)
                sock.connect(url)
            feed = self._feed(pod)
            if feed is None:
                continue
            feed.connected = connected
            feed.since = self._clock()
            log.info(
                "KV events publisher " + ("connected" if connected else "disconnected"), pod=pod
            )

    async def _bound(self) -> None:
        """Bind mode: one SUB socket every pod connects to; the topic names the pod."""
        sock = self._socket(zmq.SUB)
        try:
            try:
                sock.bind(self.config.bind_endpoint)
            except zmq.ZMQError as exc:
                log.error("cannot bind the KV events socket", endpoint=self.config.bind_endpoint,
                          error=str(exc))  # fmt: skip
                raise
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.bound_port = int(endpoint.rsplit(":", 1)[1])
            sock.setsockopt(zmq.SUBSCRIBE, self.config.topic_filter.encode())
            log.info("KV events socket bound", endpoint=endpoint)
            while True:
                for _ in range(MESSAGES_PER_TURN):
                    frames = await sock.recv_multipart(copy=True)
                    await self._on_bound_frames(frames)
                    if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        break
                await asyncio.sleep(0)
        finally:
            sock.close(linger=0)

    async def _on_bound_frames(self, frames: list[bytes]) -> None:
        topic = frames[0].decode("utf-8", "replace") if frames else ""
        pod = topic_pod(topic)
        if pod is None or pod not in self._pods:
            self._error(
                "unknown_topic", "KV events from a topic naming no pod of the pool",
                topic=clip(topic, 80),
            )  # fmt: skip
            return
        await self._on_frames(pod, frames)

    async def _sweep(self) -> None:
        config = self.config
        while True:
            await asyncio.sleep(config.sweep_interval)
            now = self._clock()
            for pod, feed in list(self._feeds.items()):
                dead = (
                    not self.bind_mode
                    and not feed.connected
                    and now - feed.since > config.dead_after
                )
                silent = config.silence_timeout > 0 and now - feed.last_at > config.silence_timeout
                if (dead or silent) and self.index.blocks_of(pod):
                    log.warning(
                        "KV events publisher " + ("gone" if dead else "silent") + "; its blocks "
                        "no longer count", pod=pod,
                    )  # fmt: skip
                    self.index.drop(pod)
                    feed.last_seq = None  # the next message starts its view again

    # -- one message ----------------------------------------------------------------------------

    def _feed(self, pod: str) -> Feed | None:
        if pod not in self._pods:
            return None
        feed = self._feeds.get(pod)
        if feed is None:
            feed = self._feeds[pod] = Feed(self._clock())
        return feed

    async def _on_frames(self, pod: str, frames: list[bytes]) -> None:
        feed = self._feed(pod)
        if feed is None:
            return
        feed.last_at = feed.last_message_at = self._clock()
        try:
            message = split_frames(frames, self.config.max_message_bytes)
        except KVEventsError as exc:
            self._error("decode", "malformed KV events message", pod=pod, error=str(exc))
            return
        await self.on_message(pod, message)

    async def on_message(self, pod: str, message: Message) -> None:
        """One published message of ``pod``'s, in sequence order or not."""
        feed = self._feed(pod)
        if feed is None:
            return
        seq, last = message.seq, feed.last_seq
        if last is not None and seq <= last:
            if feed.dup_floor is not None and seq >= feed.dup_floor:
                return  # already applied from a replay
            log.info("KV events sequence went back: the publisher restarted", pod=pod,
                     seq=seq, last=last)  # fmt: skip
            self.index.drop(pod)
            feed.rebuilds += 1
            last = feed.last_seq = None
        if last is None:
            if seq > 0 and self.config.replay_port:
                # what it still buffers, from wherever its buffer begins
                await self._replay(pod, feed, 0, seq, anywhere=True)
        elif seq > last + 1:
            repaired = bool(self.config.replay_port) and await self._replay(
                pod, feed, last + 1, seq
            )
            if self._observer is not None:
                self._observer.kv_events_gap(repaired)
            if repaired:
                feed.replays += 1
            else:
                feed.rebuilds += 1
                log.warning("KV events lost; rebuilding the pod's view from new events",
                            pod=pod, missed=seq - last - 1)  # fmt: skip
                self.index.drop(pod)
        else:
            feed.dup_floor = None
        if not self._apply(pod, feed, message):
            self.index.drop(pod)  # a batch lost is a gap: what it removed may still count
            feed.rebuilds += 1

    def _apply(self, pod: str, feed: Feed, message: Message) -> bool:
        feed.last_seq = message.seq
        try:
            batch = decode_batch(message.payload)
        except KVEventsError as exc:
            self._error("decode", "KV events batch that does not decode", pod=pod,
                        seq=message.seq, error=str(exc))  # fmt: skip
            return False
        try:
            self.index.apply(pod, batch.events)
        except Exception:  # a bug here must not end the subscription; the view is suspect
            log.exception("KV events batch could not be applied", pod=pod, seq=message.seq)
            return False
        feed.events += len(batch.events)
        if self._observer is not None:
            self._observer.kv_events_received(len(batch.events))
            if batch.unknown:
                self._observer.kv_events_error("unknown_event")
        return True

    async def _replay(
        self, pod: str, feed: Feed, start: int, until: int, *, anywhere: bool = False
    ) -> bool:
        """Ask the pod's replay socket for ``start`` on and apply those before ``until``;
        True when every one of them came (``anywhere``: the first may come later)."""
        host = f"[{pod}]" if ":" in pod else pod
        sock = self._socket(zmq.DEALER)
        replay = Replay(start, until, anywhere=anywhere)
        try:
            sock.connect(f"tcp://{host}:{self.config.replay_port}")
            applied = await replay.run(
                sock,
                lambda seq, payload: self._apply(pod, feed, Message("", seq, payload)),
                seconds=self.config.replay_timeout,
                max_messages=self.config.max_replay_messages,
                max_bytes=self.config.max_message_bytes,
                clock=self._clock,
            )
            if not applied:
                return False
        except (TimeoutError, KVEventsError, zmq.ZMQError) as exc:
            self._error("replay", "KV events replay failed", pod=pod, error=str(exc))
        finally:
            sock.close(linger=0)
        feed.dup_floor = start
        log.info("KV events replayed", pod=pod, start=start, until=until,
                 complete=replay.complete)  # fmt: skip
        return replay.complete

    def _error(self, kind: str, message: str, **fields: object) -> None:
        log.warning(message, **fields)
        if self._observer is not None:
            self._observer.kv_events_error(kind)
