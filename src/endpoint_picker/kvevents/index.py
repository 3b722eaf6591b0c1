"""Which endpoint holds which KV block, from the events, keyed by the EPP's own block hashes.

vLLM names a block by its own hash (seeded per process by ``PYTHONHASHSEED`` or at random, over
sha256 or another algorithm): the EPP cannot reproduce it for a prompt without knowing every
server's seed and algorithm. So the index keys each block by the EPP's own hash, computed from
the token ids the ``BlockStored`` event carries, chained per block of ``block_size`` tokens the
way vLLM chains its own (each block's hash covers its parent's), and seeded by ``hashSeed``:
the scorer computes the same keys from the prompt's tokens. Per endpoint it maps the engine's
hash to the EPP's, so that ``BlockRemoved`` (engine hashes only) finds its blocks, and so that a
``BlockStored`` whose parent was stored earlier continues that chain.

The chain's root is the LoRA adapter's name for an adapter's blocks (vLLM hashes the LoRA name
into every block of an adapter's request), empty for the base model. A block vLLM hashed with
other extra keys (a cache salt, multimodal inputs) is tainted with them, so a text prompt never
matches it. Only the GPU tier (``medium`` nil or ``GPU``) and the first KV-cache group count.

Bounded: at most ``max_blocks_per_endpoint`` blocks an endpoint (its least recently stored go
first) and ``max_blocks`` in all (the largest endpoint's oldest go first). Nothing here is keyed
by what a client sends: keys are hashes of tokens a model server reported.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from hashlib import blake2b

import msgpack
import structlog

from endpoint_picker.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
)

log = structlog.get_logger(__name__)

MAX_ADAPTERS = 1024  # LoRA names remembered (from events), to root a request's chain


class BlockHasher:
    """The EPP's chained block hashes: 8 bytes of keyed BLAKE2b per block, as ints."""

    __slots__ = ("_key", "_keyed", "block_size")

    def __init__(self, block_size: int, seed: str = "") -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._key = blake2b(seed.encode("utf-8", "surrogatepass"), digest_size=32).digest()
        self._keyed = blake2b(key=self._key, digest_size=8)

    def root(self, adapter: str | None) -> int:
        """The hash a chain starts from: the LoRA adapter's name, or the base model's ""."""
        name = (adapter or "").encode("utf-8", "surrogatepass")
        return int.from_bytes(blake2b(b"root\0" + name, key=self._key, digest_size=8).digest())

    def chain(
        self,
        parent: int,
        tokens: array[int],
        taints: Sequence[bytes] | None = None,
        max_blocks: int | None = None,
    ) -> list[int]:
        """The hashes of ``tokens``' full blocks, chained on ``parent``; a block's taint (its
        extra keys, packed) is hashed with it."""
        data = tokens.tobytes()
        step = self.block_size * tokens.itemsize
        blocks = len(tokens) // self.block_size
        if max_blocks is not None:
            blocks = min(blocks, max_blocks)
        fresh = self._keyed.copy  # a keyed state copied: no key setup per block
        out: list[int] = []
        digest = parent.to_bytes(8, "big")
        for i in range(blocks):
            state = fresh()
            state.update(digest)
            state.update(data[i * step : (i + 1) * step])
            if taints is not None and taints[i]:
                state.update(b"\0extra\0" + taints[i])
            digest = state.digest()
            out.append(int.from_bytes(digest))
        return out


class _EndpointView:
    """One endpoint's blocks: EPP hash -> the engine hash it was stored under (LRU order),
    and the engine hash -> EPP hash map BlockRemoved reads."""

    __slots__ = ("blocks", "engine")

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, EngineHash] = OrderedDict()
        self.engine: dict[EngineHash, int] = {}


class BlockIndex:
    """The blocks every endpoint holds, from the events each one publishes."""

    __slots__ = (
        "_adapters",
        "_holders",
        "_max_blocks",
        "_max_per_endpoint",
        "_mismatched",
        "_size",
        "_views",
        "hasher",
        "orphans",
    )

    def __init__(
        self, hasher: BlockHasher, *, max_blocks: int, max_blocks_per_endpoint: int
    ) -> None:
        self.hasher = hasher
        self._max_blocks = max_blocks
        self._max_per_endpoint = max_blocks_per_endpoint
        self._holders: dict[int, set[str]] = {}
        self._views: dict[str, _EndpointView] = {}
        self._adapters: OrderedDict[str, None] = OrderedDict()
        self._size = 0
        self.orphans = 0  # BlockStored events whose parent this index never saw (skipped)
        self._mismatched: set[str] = set()  # endpoints told once that their block size differs

    @property
    def size(self) -> int:
        """Blocks held, over every endpoint (a block two endpoints hold counts twice)."""
        return self._size

    def blocks_of(self, endpoint: str) -> int:
        view = self._views.get(endpoint)
        return 0 if view is None else len(view.blocks)

    @property
    def endpoints(self) -> frozenset[str]:
        return frozenset(self._views)

    def is_adapter(self, model: str) -> bool:
        """Whether ``model`` is a LoRA adapter some endpoint stored blocks for."""
        return model in self._adapters

    def apply(self, endpoint: str, events: Iterable[Event]) -> None:
        """Apply one batch's events, in order, to ``endpoint``'s view."""
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(endpoint, event)
            elif isinstance(event, BlockRemoved):
                self._removed(endpoint, event)
            elif isinstance(event, AllBlocksCleared):
                self.drop(endpoint)

    def drop(self, endpoint: str) -> None:
        """Forget everything ``endpoint`` holds (it left, restarted, reset or fell silent)."""
        view = self._views.pop(endpoint, None)
        if view is None:
            return
        for key in view.blocks:
            self._unhold(key, endpoint)
        self._size -= len(view.blocks)

    def longest_prefix(self, keys: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """How many of ``keys``' leading blocks each endpoint holds, in a row (0 when none).
        Set operations in C: a pick over hundreds of endpoints and thousands of blocks
        touches each endpoint once per block where some endpoint drops out, not per block."""
        counts = dict.fromkeys(endpoints, 0)
        alive = {e for e in counts if e in self._views}
        holders = self._holders
        reached = 0
        for key in keys:
            if not alive:
                break
            held = holders.get(key)
            if held is None:
                break
            if not held.issuperset(alive):
                for endpoint in alive - held:
                    counts[endpoint] = reached
                alive &= held
                if not alive:
                    break
            reached += 1
        for endpoint in alive:
            counts[endpoint] = reached
        return counts

    # -- the events ---------------------------------------------------------------------------

    def _stored(self, endpoint: str, event: BlockStored) -> None:
        if not _counts(event.medium, event.group_idx) or not event.block_hashes:
            return
        if event.block_size != self.hasher.block_size:
            if endpoint not in self._mismatched and len(self._mismatched) < MAX_ADAPTERS:
                self._mismatched.add(endpoint)
                log.warning(
                    "KV events with another block size than blockSize: skipped (set "
                    "tokenProcessorConfig.blockSize to the server's --block-size)",
                    endpoint=endpoint, block_size=event.block_size,
                    expected=self.hasher.block_size,
                )  # fmt: skip
            return
        view = self._views.get(endpoint)
        if event.parent_block_hash is None:
            parent = self.hasher.root(event.lora_name)
        else:
            known = view.engine.get(event.parent_block_hash) if view is not None else None
            if known is None:  # its chain began before this view did: nothing to chain on
                self.orphans += 1
                return
            parent = known
        if event.lora_name:
            self._adapter(event.lora_name)
        taints = _taints(event) if event.extra_keys is not None else None
        keys = self.hasher.chain(parent, event.token_ids, taints)
        if view is None:
            view = self._views[endpoint] = _EndpointView()
        for key, engine in zip(keys, event.block_hashes, strict=True):
            self._hold(view, endpoint, key, engine)
        while len(view.blocks) > self._max_per_endpoint:
            self._evict_oldest(view, endpoint)
        while self._size > self._max_blocks:
            largest = max(self._views, key=lambda e: len(self._views[e].blocks))
            self._evict_oldest(self._views[largest], largest)

    def _removed(self, endpoint: str, event: BlockRemoved) -> None:
        view = self._views.get(endpoint)
        if view is None or not _counts(event.medium, event.group_idx):
            return
        for engine in event.block_hashes:
            key = view.engine.pop(engine, None)
            if key is not None and view.blocks.pop(key, None) is not None:
                self._size -= 1
                self._unhold(key, endpoint)

    def _hold(self, view: _EndpointView, endpoint: str, key: int, engine: EngineHash) -> None:
        previous = view.blocks.get(key)
        if previous is None:
            self._size += 1
            self._holders.setdefault(key, set()).add(endpoint)
        else:
            view.blocks.move_to_end(key)
            if previous != engine:  # stored again under another engine hash: keep the newest
                view.engine.pop(previous, None)
        view.blocks[key] = engine
        view.engine[engine] = key

    def _evict_oldest(self, view: _EndpointView, endpoint: str) -> None:
        key, engine = view.blocks.popitem(last=False)
        view.engine.pop(engine, None)
        self._size -= 1
        self._unhold(key, endpoint)

    def _unhold(self, key: int, endpoint: str) -> None:
        held = self._holders.get(key)
        if held is not None:
            held.discard(endpoint)
            if not held:
                del self._holders[key]

    def _adapter(self, name: str) -> None:
        self._adapters[name] = None
        self._adapters.move_to_end(name)
        if len(self._adapters) > MAX_ADAPTERS:
            self._adapters.popitem(last=False)


def _counts(medium: str | None, group: int | None) -> bool:
    """Only blocks in GPU memory, of the first KV-cache group, make a prefill cheaper."""
    return (medium is None or medium.upper() == "GPU") and not group


def _taints(event: BlockStored) -> list[bytes]:
    """Each block's extra keys but the LoRA name (already the chain's root), packed."""
    assert event.extra_keys is not None
    out: list[bytes] = []
    for keys in event.extra_keys:
        rest = [k for k in keys if k != event.lora_name] if keys else []
        out.append(msgpack.packb(rest) if rest else b"")
    return out
