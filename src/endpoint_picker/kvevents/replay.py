"""Asking a publisher's replay socket for the messages a subscriber missed (vLLM's protocol).

vLLM's ``ZmqEventPublisher`` keeps its last ``buffer_steps`` messages and answers on a ROUTER
socket: a DEALER sends ``[b"", start-seq as 8 bytes big-endian]``; the answer is
``[b"", seq, payload]`` per buffered message from ``start`` on, then
``[b"", -1 as 8 signed bytes, b""]``. A publisher that puts the topic before ``seq`` (the
simulator's current wire) is read too. The subscriber applies what comes, in order, and learns
whether the hole it asked about was filled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq.asyncio

from endpoint_picker.errors import KVEventsError

END_SEQ = -1  # the replay answer's last frame, as vLLM sends it (signed)


class Replay:
    """One request to a replay socket, for ``start`` up to (not including) ``until``;
    ``anywhere``: the publisher's buffer may begin after ``start`` (a first message)."""

    __slots__ = ("anywhere", "expected", "start", "until")

    def __init__(self, start: int, until: int, *, anywhere: bool = False) -> None:
        self.start = start
        self.until = until
        self.anywhere = anywhere
        self.expected = start  # the next sequence number wanted

    @property
    def complete(self) -> bool:
        """Whether every message asked for came (``anywhere``: every one from the first)."""
        return self.expected == self.until or (self.anywhere and self.expected > self.start)

    async def run(
        self,
        sock: zmq.asyncio.Socket,
        apply: Callable[[int, bytes], bool],
        *,
        seconds: float,
        max_messages: int,
        max_bytes: int,
        clock: Callable[[], float],
    ) -> bool:
        """Ask on ``sock`` (a connected DEALER) and ``apply`` each wanted message in order;
        False when ``apply`` refused one. Raises ``KVEventsError`` on a malformed answer,
        ``TimeoutError`` past ``seconds``, ``zmq.ZMQError`` from the socket."""
        await sock.send_multipart([b"", self.start.to_bytes(8, "big")])
        deadline = clock() + seconds
        for _ in range(max_messages + 1):
            remaining = deadline - clock()
            if remaining <= 0:
                break
            frames = await asyncio.wait_for(sock.recv_multipart(), remaining)
            if len(frames) == 4 and not frames[0]:
                del frames[1]  # the topic, which newer publishers put before seq
            if len(frames) != 3 or frames[0] or len(frames[1]) != 8:
                raise KVEventsError(f"a replay answer is [b'', (topic,) seq, payload], got "
                                    f"{len(frames)} frames")  # fmt: skip
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == END_SEQ:
                break
            if seq < self.expected or seq >= self.until:
                continue
            if seq > self.expected and not (self.anywhere and self.expected == self.start):
                break  # the buffer no longer has them, or a hole in the answer
            if len(frames[2]) > max_bytes:
                raise KVEventsError(f"replayed payload of {len(frames[2])} bytes")
            self.expected = seq + 1
            if not apply(seq, bytes(frames[2])):
                return False
        return True
