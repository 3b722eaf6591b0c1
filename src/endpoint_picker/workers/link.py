"""The parent's end of one worker's channel: frames out, answers and serving state in.

Writes never wait: a frame is queued on the socket's transport. A worker that stops reading
(wedged) lets its backlog grow; past ``MAX_BACKLOG`` ``send`` says so and the supervisor
replaces the worker rather than buffer without bound. The backlog is what was queued before the
frame at hand: one large message (split into frames) to a worker that reads is no sign of a
wedge. A channel the parent stops reading is logged with why: the worker's exit (an end of
channel at a message boundary) or what it sent that could not be read.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from typing import Any

import structlog

from endpoint_picker.workers.messages import (
    Answer,
    Ask,
    ChannelClosed,
    Final,
    Retire,
    Serving,
    encode,
    read_message,
)

log = structlog.get_logger(__name__)

MAX_BACKLOG = 16 * 1024 * 1024  # bytes queued for one worker before it counts as wedged


class WorkerLink:
    """One worker's channel; ``run`` reads it until the worker closes it (by exiting)."""

    def __init__(
        self,
        index: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_serving: Callable[[int, bool], None],
    ) -> None:
        self.index = index
        self._reader = reader
        self._writer = writer
        self._on_serving = on_serving
        self._asks = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self.serving = False
        self.retiring = asyncio.Event()  # the worker asked to be replaced (``Retire``)
        self.final: bytes | None = None  # its last exposition, when it exited after a drain

    def send(self, frame: bytes) -> bool:
        """Queue ``frame``; False when the worker is too far behind (a closing channel takes
        nothing and says True: its worker is exiting, and the supervisor sees that)."""
        if self._writer.is_closing():
            return True
        behind = self._writer.transport.get_write_buffer_size() > MAX_BACKLOG
        self._writer.write(frame)
        return not behind

    async def ask(self, what: str, within: float) -> Any | None:
        """The worker's answer to ``what``, or None when it does not answer in time."""
        ask_id = next(self._asks)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[ask_id] = future
        try:
            if not self.send(encode(Ask(ask_id, what))):
                return None
            return await asyncio.wait_for(future, within)
        except TimeoutError:
            log.warning("worker did not answer", worker=self.index, question=what)
            return None
        finally:
            self._pending.pop(ask_id, None)

    async def run(self) -> None:
        """Dispatch the worker's messages until its end closes."""
        try:
            while True:
                message = await read_message(self._reader)
                if isinstance(message, Answer):
                    future = self._pending.get(message.ask_id)
                    if future is not None and not future.done():
                        future.set_result(message.payload)
                elif isinstance(message, Serving):
                    self._set_serving(message.serving)
                elif isinstance(message, Final):
                    self.final = message.metrics
                elif isinstance(message, Retire):
                    log.info("worker asks to be replaced", worker=self.index,
                             streams=message.streams)  # fmt: skip
                    self.retiring.set()
        except ChannelClosed as exc:
            if exc.eof:
                log.info("worker channel closed", worker=self.index)
            else:
                log.error("dropping the worker's channel: it sent what cannot be read",
                          worker=self.index, reason=str(exc))  # fmt: skip
        finally:
            self._set_serving(False)
            for future in self._pending.values():
                if not future.done():
                    future.set_result(None)

    def _set_serving(self, serving: bool) -> None:
        if serving != self.serving:
            self.serving = serving
            self._on_serving(self.index, serving)

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
