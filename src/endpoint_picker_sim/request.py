"""A request inside the engine: scheduling state plus a way for its handler to await tokens."""

from __future__ import annotations

import asyncio

FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class SimRequest:
    """Mutable scheduling state of one request; only the engine writes it."""

    __slots__ = (
        "_waiter",
        "arrival",
        "block_hashes",
        "cached_blocks",
        "finish_reason",
        "finished",
        "first_token_at",
        "generated",
        "last_token_at",
        "lora",
        "max_tokens",
        "num_computed",
        "prompt_len",
        "scheduled_at",
        "table",
        "text",
        "token_ids",
        "wait_for",
    )

    def __init__(
        self,
        prompt_len: int,
        block_hashes: tuple[int, ...],
        max_tokens: int,
        lora: str | None = None,
        text: str | None = None,
        token_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.prompt_len = prompt_len
        # The prompt's token ids, when the server publishes KV events or has a tokenizer file
        # (block hashes then chain over ids); None: hashes over the approximate tokenizer's text.
        self.token_ids = token_ids
        # The prompt text, so the generated blocks can be hashed when the request finishes.
        self.text = text
        self.block_hashes = block_hashes
        self.max_tokens = max_tokens
        self.lora = lora
        self.arrival = 0.0
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        # Tokens whose KV is computed; prompt and generated tokens alike (recomputed on preemption).
        self.num_computed = 0
        self.generated = 0
        # Leading prompt blocks already registered in the prefix cache.
        self.cached_blocks = 0
        self.table: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None
        # The handler is woken once ``generated`` reaches this; max_tokens+1 means "not waiting".
        self.wait_for = max_tokens + 1
        self._waiter: asyncio.Future[None] | None = None

    async def tokens(self, at_least: int) -> int:
        """Wait until ``at_least`` tokens exist (or the request ended); return the count."""
        if self.generated < at_least and not self.finished:
            self.wait_for = at_least
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
                self.wait_for = self.max_tokens + 1
        return self.generated

    def wake(self) -> None:
        """Resolve the handler's wait, if any."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def finish(self, reason: str) -> None:
        """Mark finished and release the handler."""
        self.finished = True
        self.finish_reason = reason
        self.wake()
