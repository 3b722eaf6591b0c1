"""One simulated vLLM engine: a scheduler stepped by an asyncio task, as vLLM v1 schedules.

Each step (1) keeps running requests going, oldest first, preempting the newest running request
back to the head of the queue when KV blocks run out; (2) if nothing was preempted, admits
waiting requests in FIFO order while the token budget, ``max_num_seqs``, free blocks and LoRA
slots allow, reusing cached prefix blocks; (3) sleeps for the step's modelled duration; (4)
commits: computed tokens advance, finished prompt blocks join the prefix cache, each request
whose tokens are all computed samples one token. Long prompts are prefilled in chunks.

KV-cache events (when ``on_events`` is set): blocks evicted while scheduling and blocks cached
while committing are sent as one batch per step, after the commit, as vLLM sends one
``KVEventBatch`` per engine step. (vLLM marks a prompt's full blocks cached when it schedules
them, one step before the simulator, which caches them once computed.)
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence

from endpoint_picker_sim.clock import Clock
from endpoint_picker_sim.config import EngineConfig
from endpoint_picker_sim.kvcache import BlockManager
from endpoint_picker_sim.kvevents import KvEvent
from endpoint_picker_sim.loras import LoraSlots
from endpoint_picker_sim.request import FINISH_ABORT, FINISH_LENGTH, SimRequest
from endpoint_picker_sim.stats import EngineStats
from endpoint_picker_sim.tokenids import TokenIdScheme
from endpoint_picker_sim.tokenizer import extend_block_hashes, extend_id_hashes, generate_text

# Late wake-ups (timer rounding, a busy loop, a descheduled process) are caught up by starting
# the next step at the planned time, so the simulated GPU keeps its throughput. Beyond this much
# (wall seconds) the loop gives up, re-anchors to now and counts the loss as "behind".
_MAX_CATCH_UP_S = 0.02


class Engine:
    """The scheduler state and its step loop. ``step`` and ``commit`` are synchronous and pure
    with respect to time, so tests can drive them with any timestamps."""

    def __init__(
        self, config: EngineConfig, clock: Clock, token_ids: TokenIdScheme | None = None
    ) -> None:
        self.config = config
        self.clock = clock
        # Set when requests carry token ids: a finished request's reply blocks are hashed over ids.
        self.token_ids = token_ids
        self.blocks = BlockManager(config.num_gpu_blocks, config.block_size)
        # Every engine of the fleet (this process), for the oracle hit count; just this one alone.
        self.fleet: Sequence[BlockManager] = (self.blocks,)
        # Receives each step's KV-cache events (the publisher); None: events are not recorded.
        self.on_events: Callable[[list[KvEvent]], None] | None = None
        self._in_step = False
        self._pending_reset: bool | None = None
        self.stats = EngineStats()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.loras = LoraSlots(config.max_loras)
        self._wakeup = asyncio.Event()

    # -- requests -------------------------------------------------------------------------

    def add(self, req: SimRequest) -> None:
        """Queue a request (FIFO) and wake the loop."""
        req.arrival = self.clock.now()
        self.waiting.append(req)
        self.loras.queued(req.lora)
        self._wakeup.set()

    def abort(self, req: SimRequest) -> None:
        """Drop a request whose client went away, releasing its blocks."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
            self._leave_running(req)
        else:
            self.waiting.remove(req)
            self.loras.dequeued(req.lora)
        req.finish(FINISH_ABORT)
        self.stats.success_abort += 1

    @property
    def idle(self) -> bool:
        """No request running or waiting."""
        return not self.running and not self.waiting

    # -- scheduling -----------------------------------------------------------------------

    def step(self) -> tuple[list[tuple[SimRequest, int]], float]:
        """Choose this step's requests and token counts; return them and the duration (s)."""
        cfg = self.config
        bs = cfg.block_size
        blocks = self.blocks
        budget = cfg.max_num_batched_tokens
        batch: list[tuple[SimRequest, int]] = []
        prefill_tokens = 0
        decode_context = 0
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            total = req.prompt_len + req.generated
            new = min(total - req.num_computed, budget)
            need = req.num_computed + new
            if need > len(req.table) * bs:
                fits = True
                while not blocks.allocate(req.table, need):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        fits = False
                        break
                if not fits:
                    break
            batch.append((req, new))
            budget -= new
            if new == 1 and req.generated and req.num_computed >= req.prompt_len:
                decode_context += need
            else:
                prefill_tokens += new
            i += 1
        lora_load_us = 0.0
        if not preempted:
            prefill_tokens, budget, lora_load_us = self._admit(batch, budget, prefill_tokens)
        us = cfg.profile.step_us(prefill_tokens, decode_context, len(batch)) + lora_load_us
        return batch, us * 1e-6 / cfg.speed

    def _admit(
        self, batch: list[tuple[SimRequest, int]], budget: int, prefill_tokens: int
    ) -> tuple[int, int, float]:
        """Move waiting requests into the batch, FIFO, skipping those whose adapter cannot fit."""
        cfg = self.config
        bs = cfg.block_size
        waiting = self.waiting
        loras = self.loras
        skipped: list[SimRequest] = []
        lora_load_us = 0.0
        while waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = waiting[0]
            if loras.blocked(req.lora):
                skipped.append(waiting.popleft())
                continue
            # Never serve the whole prompt from cache: the last token must be computed to
            # sample from it, exactly as vLLM caps its hit.
            cacheable = (req.prompt_len - 1) // bs
            prefix = self.blocks.cached_prefix(req.block_hashes[:cacheable])
            cached = len(prefix) * bs
            new = min(req.prompt_len + req.generated - cached, budget)
            if not self.blocks.allocate(req.table, cached + new, prefix):
                break
            waiting.popleft()
            loras.dequeued(req.lora)
            req.num_computed = cached
            req.cached_blocks = len(prefix)
            if req.scheduled_at is None:
                req.scheduled_at = self.clock.now()
                self.stats.queue.observe(max(req.scheduled_at - req.arrival, 0.0))
            self.stats.prefix_queries += req.prompt_len
            self.stats.prefix_hits += cached
            if len(self.fleet) > 1:
                # The oracle: the longest prefix any server of the fleet caches right now.
                held = req.block_hashes[:cacheable]
                best = max(len(b.cached_prefix(held)) for b in self.fleet)
                self.stats.oracle_hits += best * bs
            else:
                self.stats.oracle_hits += cached
            if loras.start(req.lora):
                lora_load_us += cfg.lora_load_ms * 1000.0
            self.running.append(req)
            batch.append((req, new))
            budget -= new
            prefill_tokens += new
        if skipped:
            waiting.extendleft(reversed(skipped))
        return prefill_tokens, budget, lora_load_us

    def _preempt(self, req: SimRequest) -> None:
        """Recompute later: free the blocks and put the request back at the head of the queue."""
        self._leave_running(req)
        req.num_computed = 0
        req.cached_blocks = 0
        self.waiting.appendleft(req)
        self.loras.queued(req.lora)
        self.stats.preemptions += 1

    def _leave_running(self, req: SimRequest) -> None:
        self.blocks.free(req.table)
        self.loras.stop(req.lora)

    # -- committing -----------------------------------------------------------------------

    def commit(self, batch: list[tuple[SimRequest, int]], t: float) -> None:
        """Apply a step that ended at simulated time ``t``."""
        stats = self.stats
        bs = self.config.block_size
        any_finished = False
        itl_value = -1.0
        itl_n = 0
        for req, new in batch:
            if req.finished:
                continue  # aborted while the step ran
            req.num_computed += new
            hashes = req.block_hashes
            if req.cached_blocks < len(hashes):
                full = min(req.num_computed // bs, len(hashes))
                if full > req.cached_blocks:
                    self._cache_blocks(req, hashes, req.cached_blocks, full)
                    req.cached_blocks = full
            if req.num_computed < req.prompt_len + req.generated:
                continue  # a prefill chunk; no token yet
            req.generated += 1
            stats.generation_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = t
                stats.prompt_tokens += req.prompt_len
                stats.ttft.observe(max(t - req.arrival, 0.0))
            else:
                gap = t - req.last_token_at
                # Most decoding requests share the same gap: observe them in one go.
                if gap == itl_value:
                    itl_n += 1
                else:
                    if itl_n:
                        stats.itl.observe(itl_value, itl_n)
                    itl_value, itl_n = gap, 1
            req.last_token_at = t
            if req.generated >= req.max_tokens:
                self._cache_generated(req)
                self._leave_running(req)
                req.finish(FINISH_LENGTH)
                stats.success_length += 1
                stats.e2e.observe(max(t - req.arrival, 0.0))
                any_finished = True
            elif req.generated >= req.wait_for:
                req.wake()
        if itl_n:
            stats.itl.observe(itl_value, itl_n)
        if any_finished:
            self.running = [r for r in self.running if not r.finished]
        self._update_lora_info()

    def _cache_blocks(
        self,
        req: SimRequest,
        hashes: Sequence[int],
        start: int,
        end: int,
        ids: Sequence[int] | None = None,
    ) -> None:
        """Cache blocks ``start..end-1`` of ``req`` (``hashes`` and ``ids``, its token ids unless
        given, cover at least that far), announced as the request's adapter when events are on."""
        blocks, lora = self.blocks, req.lora
        ids = req.token_ids if ids is None else ids
        announce = blocks.events is not None and ids is not None
        lora_id = self.loras.id_of(lora) if announce and lora is not None else None
        blocks.cache_run(req.table, hashes, start, end, ids, lora, lora_id)

    def _cache_generated(self, req: SimRequest) -> None:
        """Cache the finished request's full blocks past its prompt, as vLLM caches decode blocks:
        a chat's next turn, which quotes this reply, then hits them too."""
        bs = self.config.block_size
        # The last sampled token's KV was never computed.
        limit = min(req.num_computed // bs, len(req.table))
        known = req.block_hashes
        if limit <= len(known):
            return
        reply = generate_text(0, req.generated)
        if req.token_ids is not None and self.token_ids is not None:
            ids = self.token_ids.extend(req.text, req.token_ids, reply)
            more = extend_id_hashes(ids, bs, req.lora, known, limit)
            self._cache_blocks(req, (*known, *more), len(known), len(known) + len(more), ids)
            return
        if req.text is None:
            return
        full = req.text + reply
        table = req.table
        for k, h in enumerate(extend_block_hashes(full, bs, req.lora, known, limit),
                              start=len(known)):  # fmt: skip
            self.blocks.cache(table[k], h)

    def _update_lora_info(self) -> None:
        # vLLM stamps the gauge with the wall time on every step.
        self.stats.set_lora_info(*self.loras.label(), time.time())

    # -- prefix-cache reset and events -----------------------------------------------------

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool | None:
        """vLLM's ``reset_prefix_cache``: forget every cached block (``AllBlocksCleared``).

        ``reset_running_requests`` first preempts every running request (they recompute later),
        so the reset succeeds under load; without it a reset with blocks in use is refused
        (False), as in vLLM. During a step the reset waits for the step's end (None).
        """
        if self._in_step:
            self._pending_reset = reset_running_requests or bool(self._pending_reset)
            return None
        done = self._reset_now(reset_running_requests)
        self.flush_events()
        return done

    def _reset_now(self, reset_running_requests: bool) -> bool:
        if reset_running_requests:
            while self.running:
                self._preempt(self.running.pop())
        return self.blocks.reset_prefix_cache()

    def restart(self) -> None:
        """A crash and restart of the server: every request fails, the cache is empty, and
        nothing is announced (the new process starts with an empty cache and says nothing)."""
        for req in [*self.running, *self.waiting]:
            self.abort(req)
        events = self.blocks.events
        self.blocks.events = None
        self.blocks.reset_prefix_cache()
        self.blocks.events = None if events is None else []
        self.loras.restart()
        self._pending_reset = None

    def flush_events(self) -> None:
        """Send the events recorded since the last flush as one batch."""
        if self.on_events is not None:
            events = self.blocks.take_events()
            if events:
                self.on_events(events)

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        """Step forever; wait on an event while idle rather than spin."""
        clock = self.clock
        stats = self.stats
        scale = self.config.time_scale
        anchor = clock.now()
        while True:
            if self.idle:
                self._wakeup.clear()
                await self._wakeup.wait()
                anchor = clock.now()
            batch, duration = self.step()
            if not batch:
                self.flush_events()
                self._wakeup.clear()
                await self._wakeup.wait()
                anchor = clock.now()
                continue
            end = anchor + duration
            self._in_step = True
            try:
                error = await clock.sleep_until(end)
                self.commit(batch, end)
            finally:
                self._in_step = False
            if self._pending_reset is not None:
                self._reset_now(self._pending_reset)
                self._pending_reset = None
            self.flush_events()
            late = error if error > 0 else 0.0
            stats.steps += 1
            stats.step_lag.observe(late)
            stats.step_planned_wall += duration / scale
            stats.step_late_wall += late
            stats.step_early_wall -= error - late
            if late > _MAX_CATCH_UP_S:
                # Too far behind to catch up: the simulated GPU lost this time for good.
                stats.step_behind_wall += late
                anchor = clock.now()
            else:
                anchor = end

    def shutdown(self) -> None:
        """Abort everything still queued or running so no handler waits forever."""
        for req in [*self.running, *self.waiting]:
            self.abort(req)
