"""``precise-prefix-cache-scorer``: score each endpoint by the prefix of the prompt it really
holds, from the KV-cache events its vLLM publishes (``endpoint_picker.kvevents``).

The prompt is tokenized with its model's tokenizer (``--tokenizer``; chat requests through the
chat template), cut into blocks of ``blockSize`` tokens and hashed as the index hashes the
blocks the servers report; an endpoint scores the fraction of the prompt's blocks it holds in a
row from the first. Every worker and replica subscribes to the same events, so they score
alike without talking to each other.

Tokenizing a long prompt takes milliseconds (the bench's 16 KB prompts: 10 ms; docs/scheduling.md
has the measurements), so the scorer is also a ``Preparer`` and tokenizes at most about
``inlineBytes`` characters of a prompt on the event loop, through a prefix store
(``prefixStoreConfig``, ``kvevents.prefixstore``): a prompt sharing a text prefix with an earlier
one takes that prefix's tokens and tokenizes its tail only. A prompt with more than that left
to tokenize is scored on its leading ``inlineBytes`` characters' blocks while a thread tokenizes
it whole for the store (at most ``maxPendingTokenize`` at a time); the request never waits
for a thread. With ``prefixStoreConfig.cacheSize: 0`` the store is off and, as before it, a body
under ``inlineBytes`` is tokenized on the loop and a longer one on a thread while its request
waits (past ``maxPendingTokenize``: scored 0). The block hashes of recent prompts are kept (LRU,
``maxCachedBlocks`` in all), so a repeated prompt costs a lookup; with the store, the hashes of
token prefixes too (``kvevents.blockmemo``).

A request the scorer cannot tokenize (its model has no tokenizer, a batch of prompts, an
embeddings request) scores 0 everywhere: the weighted sum is then the other scorers'.
Parameter names follow llm-d's scorer where they exist (``tokenProcessorConfig``,
``kvEventsConfig``, ``indexerConfig``).
"""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog

from endpoint_picker.errors import ConfigError
from endpoint_picker.kvevents.blockmemo import BlockMemo
from endpoint_picker.kvevents.feeds import KVEventsConfig
from endpoint_picker.kvevents.index import BlockHasher, BlockIndex
from endpoint_picker.kvevents.prefixstore import GUARD, OVERLAP, PrefixStore, Tokens
from endpoint_picker.kvevents.subscriber import KVEventsHub
from endpoint_picker.kvevents.tokens import Prompt, PromptTokenizer, load_tokenizers
from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling.framework import OffLoopWork
from endpoint_picker.scheduling.registry import Params, PluginContext
from endpoint_picker.types import EndpointState

log = structlog.get_logger(__name__)

SHARED_KEY = "kv-events"  # PluginContext.shared: the hub the app runs


class PrecisePrefixCacheScorer:
    """Fraction of the prompt's leading blocks each endpoint holds, per the KV events."""

    __slots__ = (
        "_cache",
        "_cached_blocks",
        "_filler",
        "_inline_bytes",
        "_max_blocks",
        "_max_cached",
        "_max_pending",
        "_memo",
        "_pending",
        "_store",
        "_tokenizer",
        "hub",
        "index",
    )

    def __init__(
        self,
        hub: KVEventsHub,
        tokenizer: PromptTokenizer,
        *,
        max_prefix_blocks: int = 8192,
        inline_bytes: int = 1024,
        max_pending: int = 2,
        max_cached_blocks: int = 1 << 20,
        store: PrefixStore | None = None,
    ) -> None:
        self.hub = hub
        self.index = hub.index
        self._tokenizer = tokenizer
        self._max_blocks = max_prefix_blocks
        self._inline_bytes = inline_bytes
        self._max_pending = max_pending
        self._max_cached = max_cached_blocks
        self._pending = 0
        self._store = store
        self._memo = BlockMemo(self.index.hasher)  # on the loop only (the store's path)
        self._filler: ThreadPoolExecutor | None = None
        # request key -> (chain root, block keys, whether only the prompt's leading blocks)
        self._cache: OrderedDict[bytes, tuple[int, tuple[int, ...], bool]] = OrderedDict()
        self._cached_blocks = 0

    @classmethod
    def from_params(cls, name: str, params: Params, ctx: PluginContext) -> PrecisePrefixCacheScorer:
        tokens = params.section("tokenProcessorConfig")
        block_size = tokens.integer(
            "blockSizeTokens", tokens.integer("blockSize", 16, minimum=1), minimum=1
        )
        seed = tokens.text("hashSeed")
        tokens.finish()
        events = params.section("kvEventsConfig")
        discovery = events.section("podDiscoveryConfig")
        port = discovery.integer("socketPort", 5557, minimum=1)
        discovery.finish()
        config = KVEventsConfig(
            port=events.integer("socketPort", port, minimum=1),
            bind_endpoint=events.text("zmqEndpoint"),
            replay_port=events.integer("replayPort", 0, minimum=0),
            topic_filter=events.text("topicFilter"),
            max_message_bytes=events.integer("maxMessageBytes", 16 << 20, minimum=1024),
            dead_after=events.duration("deadAfter", 30.0),
            silence_timeout=events.duration("silenceTimeout", 0.0),
            replay_timeout=events.duration("replayTimeout", 2.0),
        )
        discover = events.boolean("discoverPods", not config.bind_endpoint)
        if discover == bool(config.bind_endpoint):
            raise ConfigError(
                "discoverPods: true subscribes to every pod (no zmqEndpoint); false binds "
                "zmqEndpoint, which every pod connects to",
                events.path("discoverPods"),
            )
        events.finish()
        indexer = params.section("indexerConfig")
        block_index = indexer.section("kvBlockIndexConfig")
        memory = block_index.section("inMemoryConfig")
        size = memory.integer("size", 1_000_000, minimum=1)
        memory.finish()
        block_index.finish()
        per_endpoint = indexer.integer("maxBlocksPerEndpoint", min(size, 250_000), minimum=1)
        indexer.finish()
        prefix = params.section("prefixStoreConfig")
        chunks = prefix.integer("cacheSize", 32_768, minimum=0)
        chunk_chars = prefix.integer("blockSize", 256, minimum=GUARD + OVERLAP + 1)
        prefix.finish()
        if SHARED_KEY in ctx.shared:
            raise ConfigError(
                "one precise-prefix-cache-scorer per config (list it in several profiles instead)",
                params.path("kvEventsConfig"),
            )
        index = BlockIndex(
            BlockHasher(block_size, seed), max_blocks=size, max_blocks_per_endpoint=per_endpoint
        )
        hub = KVEventsHub(config, index, observer=ctx.observer, clock=ctx.clock)
        ctx.shared[SHARED_KEY] = hub
        scorer = cls(
            hub,
            PromptTokenizer(load_tokenizers(ctx.settings.tokenizers)),
            max_prefix_blocks=params.integer("maxPrefixBlocks", 8192, minimum=1),
            inline_bytes=params.integer("inlineBytes", 1024, minimum=0),
            max_pending=params.integer("maxPendingTokenize", 2, minimum=0),
            max_cached_blocks=params.integer("maxCachedBlocks", 1 << 20, minimum=0),
            store=PrefixStore(chunk_chars, chunks) if chunks else None,
        )
        hub.tokenized_models = tuple(m for m, _ in ctx.settings.tokenizers)
        return scorer

    # -- the request path -----------------------------------------------------------------------

    def prepare(self, request: LLMRequest) -> OffLoopWork | None:
        """Tokenize now (a short prompt), hand back work for a thread (a long one), or
        nothing (cached, no tokenizer, or too much pending already)."""
        key = self._tokenizer.key(request)
        if key is None:
            log.debug("precise prefix: no tokens for this request (no tokenizer or no prompt)",
                      request_id=request.log_id, model=request.target_model)  # fmt: skip
            return None
        root = self._root(request)
        cached = self._cache.get(key)
        if cached is not None and cached[0] == root and not cached[2]:
            return None
        if self._store is not None:
            self._through_store(request, key, root, self._store)
            return None
        if len(request.raw_body) <= self._inline_bytes:
            self._keep(key, root, self._hash(self._tokenizer.tokens(request), root))
            return None
        if self._pending >= self._max_pending:
            log.debug("precise prefix: tokenizer busy; scored 0", request_id=request.log_id)
            return None
        self._pending += 1
        return lambda: self._off_loop(request, key, root)

    def _off_loop(self, request: LLMRequest, key: bytes, root: int) -> Callable[[], None]:
        """On a thread: tokenize and hash; the loop then keeps the result."""
        try:
            keys = self._hash(self._tokenizer.tokens(request, off_loop=True), root)
        except Exception:
            log.exception("precise prefix: tokenizing failed", request_id=request.log_id)
            keys = None

        def finish() -> None:
            self._pending -= 1
            self._keep(key, root, keys)

        return finish

    def _through_store(
        self, request: LLMRequest, key: bytes, root: int, store: PrefixStore
    ) -> None:
        """On the loop, at most about ``inlineBytes`` characters tokenized: the stored prefix
        and the new tail, or the prompt's leading characters while a thread tokenizes it
        all for the store (the request does not wait for it)."""
        prompt = self._tokenizer.prompt(request)
        if prompt is None:
            return
        if isinstance(prompt, array):  # token ids given
            self._keep(key, root, self._hash(prompt, root))
            return
        model = prompt.model
        out = store.tokenize(model.encode_tokens, prompt.root, prompt.text, prompt.special,
                             self._inline_bytes, model.appended)  # fmt: skip
        keys = tuple(self._memo.chain(root, out.ids, self._max_blocks))
        self._keep(key, root, keys, partial=not out.complete)
        if out.store:
            self._fill(prompt, store)

    def _fill(self, prompt: Prompt, store: PrefixStore) -> None:
        """Tokenize the whole prompt on a thread (``encode_batch`` lets go of the GIL) and
        store it; at most ``maxPendingTokenize`` at a time, past that the next request of
        the prefix tries again."""
        if self._pending >= self._max_pending:
            log.debug("precise prefix: tokenizer busy; the prompt is not stored")
            return

        def work(off_loop: bool) -> tuple[list[bytes], Tokens]:
            keys = store.keys(prompt.root, prompt.text)
            return keys, prompt.model.encode_tokens(prompt.text, prompt.special, off_loop)[0]

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (Director.route): here and now
            store.add(*work(False))
            return
        self._pending += 1

        def done(future: asyncio.Future[tuple[list[bytes], Tokens]]) -> None:
            self._pending -= 1
            if future.cancelled():
                return
            if (error := future.exception()) is not None:
                log.warning("precise prefix: tokenizing failed", error=str(error))
                return
            store.add(*future.result())

        loop.run_in_executor(self._thread(), work, True).add_done_callback(done)

    def _thread(self) -> ThreadPoolExecutor:
        """The one thread that tokenizes whole prompts for the store: at most a core. (Not
        at a lower priority: it holds the GIL for part of its work, and a starved holder
        would stall the event loop; measured, benchmarks/bench_precise_path.py: the loop's
        p99 lag 10.6 ms with it at nice +10, 6.7 ms without.)"""
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, "precise-tokenize")
        return self._filler

    def score(self, request: LLMRequest, endpoints: Sequence[EndpointState]) -> list[float]:
        key = self._tokenizer.key(request) if self._tokenizer else None
        cached = self._cache.get(key) if key is not None else None
        if cached is None or not cached[1] or cached[0] != self._root(request):
            return [0.0] * len(endpoints)
        self._cache.move_to_end(key)  # type: ignore[arg-type]  # not None with a cache entry
        keys = cached[1]
        counts = self.index.longest_prefix(keys, {e.endpoint.address for e in endpoints})
        total = len(keys)
        return [counts[e.endpoint.address] / total for e in endpoints]

    # -- helpers ---------------------------------------------------------------------------------

    def _root(self, request: LLMRequest) -> int:
        model = request.target_model
        return self.index.hasher.root(model if self.index.is_adapter(model) else None)

    def _hash(self, tokens: array[int] | None, root: int) -> tuple[int, ...] | None:
        if tokens is None:
            return None
        return tuple(self.index.hasher.chain(root, tokens, max_blocks=self._max_blocks))

    def _keep(
        self, key: bytes, root: int, keys: tuple[int, ...] | None, partial: bool = False
    ) -> None:
        if keys is None:
            return
        old = self._cache.pop(key, None)
        if old is not None:
            self._cached_blocks -= _cost(old[1])
        if _cost(keys) > self._max_cached:
            return
        self._cache[key] = (root, keys, partial)
        self._cached_blocks += _cost(keys)
        while self._cached_blocks > self._max_cached:
            _, (_, dropped, _) = self._cache.popitem(last=False)
            self._cached_blocks -= _cost(dropped)


def _cost(keys: tuple[int, ...]) -> int:
    """What a cached prompt counts against ``maxCachedBlocks``: its blocks, and at least one,
    so prompts shorter than a block (no block at all) cannot pile up uncounted."""
    return len(keys) or 1
