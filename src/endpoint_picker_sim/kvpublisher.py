"""One server's KV-event publisher, on the wire as vLLM's ``ZmqEventPublisher``.

- A PUB socket sends each batch as three frames ``[topic, seq, payload]``: ``seq`` counts batches
  from 0 as an 8-byte big-endian unsigned integer, ``payload`` is the msgpack ``KVEventBatch``.
  The endpoint binds when it holds a wildcard (``tcp://*:5557``, ``::``, ``ipc://``,
  ``inproc://``) and connects otherwise (every pod connecting to one subscriber that binds,
  as llm-d deploys it): vLLM's own rule.
- A ROUTER socket (``replay_endpoint``, always bound) answers a replay request, one frame holding
  a start ``seq`` (8 bytes, big-endian) behind the REQ/DEALER empty delimiter, with every batch
  still buffered from that ``seq`` on and then an end marker whose ``seq`` frame is -1 (eight 0xff
  bytes). vLLM >= v0.26 (vllm-project/vllm#45177) sends ``[topic, seq, payload]`` per batch and
  ``[b"", END, b""]`` to end; before, ``[seq, payload]`` and ``[END, b""]`` (``legacy`` wire).
- The buffer keeps the last ``buffer_steps`` batches; PUB drops past ``hwm`` queued messages per
  subscriber, as ZeroMQ does, and never blocks the engine.

vLLM publishes from a thread fed by a queue (``max_queue_size``); the simulator has no thread: it
sends from the engine's step, non-blocking, and serves replays from an asyncio task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from endpoint_picker_sim.config import KvEventsConfig
from endpoint_picker_sim.kvevents import KvEvent, encode_batch

log = logging.getLogger("endpoint_picker_sim")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local transport, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def for_server(text: str, host: str, index: int, servers: int) -> str:
    """An endpoint or topic as pod ``index`` (address ``host``) of this process sees it.

    ``${POD_IP}`` / ``$POD_IP`` become ``host``, as the shell of a pod spec expands them (llm-d's
    topic ``kv@${POD_IP}@<model>``); a tcp wildcard becomes ``host``, because every simulated pod
    shares this machine's interfaces where real pods each have their own; with several servers an
    ipc/inproc path gets vLLM's per-rank suffix ``_dp<index>``.
    """
    text = text.replace("${POD_IP}", host).replace("$POD_IP", host)
    if text.startswith("tcp://"):
        return text.replace("tcp://*:", f"tcp://{host}:").replace("tcp://[::]:", f"tcp://{host}:")
    if servers > 1 and text.startswith(("ipc://", "inproc://")):
        return f"{text}_dp{index}"
    return text


def _last_endpoint(sock: zmq.Socket[Any], fallback: str) -> str:
    """The endpoint as bound (an ephemeral ``:*`` port resolved), or ``fallback``."""
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) and last else fallback


class KvEventPublisher:
    """PUB + replay ROUTER for one simulated server; ``publish`` is cheap and never blocks."""

    def __init__(self, config: KvEventsConfig, host: str, index: int, servers: int) -> None:
        self.config = config
        # Resolved for this server; once started, as bound (an ephemeral port resolved).
        self.endpoint = for_server(config.endpoint, host, index, servers)
        self.replay_endpoint = (
            None
            if config.replay_endpoint is None
            else for_server(config.replay_endpoint, host, index, servers)
        )
        self.topic = for_server(config.topic, host, index, servers).encode()
        # decided on the endpoint as configured: ``tcp://*:5557`` binds (on ``host``), though
        # the resolved ``tcp://<host>:5557`` has no wildcard left
        self.binds = binds(config.endpoint)
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.asyncio.Context.instance()
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    def start(self) -> None:
        """Open the sockets (bind or connect) and start serving replays."""
        pub: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            if self.binds:
                pub.bind(self.endpoint)
            else:
                pub.connect(self.endpoint)
        except zmq.ZMQError:
            pub.close(0)
            raise
        self._pub = pub
        self.endpoint = _last_endpoint(pub, self.endpoint)
        if self.replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                router.bind(self.replay_endpoint)
            except zmq.ZMQError:
                router.close(0)
                self.close_sockets()
                raise
            self._router = router
            self.replay_endpoint = _last_endpoint(router, self.replay_endpoint)
            self._replay_task = asyncio.create_task(
                self._serve_replays(router), name=f"sim-kv-replay-{self.replay_endpoint}"
            )
            self._replay_task.add_done_callback(self._replay_done)

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Send one step's events as one batch with the next sequence number."""
        if self._pub is None or not events:
            return
        payload = encode_batch(time.time(), events, self.config.encoding)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        # zmq.Again: a connecting PUB with no peer yet; the batch stays in the replay buffer.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    def restart(self) -> None:
        """A new process: sequence numbers start again at 0, the replay buffer is empty."""
        self._seq = 0
        self._buffer.clear()

    def _replay_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("kv-events replay on %s failed", self.replay_endpoint,
                      exc_info=task.exception())  # fmt: skip

    async def _serve_replays(self, router: zmq.asyncio.Socket) -> None:
        legacy = self.config.wire == "legacy"
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("kv-events replay: ignoring a request of %d frames", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    head = [client, b""] if legacy else [client, b"", self.topic]
                    await router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end = [END_SEQ, b""] if legacy else [b"", END_SEQ, b""]
            await router.send_multipart([client, b"", *end])

    def close_sockets(self) -> None:
        """Close both sockets at once (linger 0); the shared context stays."""
        if self._pub is not None:
            self._pub.close(0)
            self._pub = None
        if self._router is not None:
            self._router.close(0)
            self._router = None

    async def stop(self) -> None:
        """Stop the replay task and close the sockets."""
        task = self._replay_task
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
            self._replay_task = None
        self.close_sockets()
