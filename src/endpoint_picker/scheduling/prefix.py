"""Prompt prefixes as chains of block hashes, and an approximate index of who caches what.

A model server caches a prompt's KV blocks by a chain of hashes, each block's hash covering
everything before it, so two prompts share cached blocks exactly as far as they share a prefix.
The EPP cannot see tokens, so it cuts the prompt text into blocks of ``block_chars`` characters
(about 4 characters a token) and chains their hashes the same way, seeded by the target model:
an adapter and its base model never share entries, as in vLLM.

Chat requests hash their messages in order, roles included (``role``, a separator, the content,
a terminator): the next turn of a conversation starts with the same bytes as the previous turn's
whole prompt, so it matches every block of it.

Hashes are BLAKE2b (8 bytes), not Python's ``hash``: they must agree across worker processes
and replicas, which per-process hash randomisation would break. Only full blocks count, and at
most ``max_blocks`` of them: hashing a 200 KB prompt stops after ``max_blocks`` blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from hashlib import blake2b
from random import Random
from typing import Any, Protocol, runtime_checkable

import orjson

from endpoint_picker.requests import Api, LLMRequest

CHARS_PER_TOKEN = 4
_ROLE_END = "\x1f"
_MESSAGE_END = "\x1e"


def _content_text(content: Any) -> str:
    """Content as text: a string as it is, anything else as stable JSON ("" when it nests
    deeper than the serialiser allows: such a prompt just gets no prefix affinity)."""
    if isinstance(content, str):
        return content
    try:
        return orjson.dumps(content).decode()
    except TypeError:  # orjson.JSONEncodeError: nested past its recursion limit
        return ""


def prompt_prefix_text(request: LLMRequest, limit: int) -> str:
    """The first ``limit`` characters of the request's prompt, as the prefix index sees it."""
    body = request.body
    if request.api is Api.CHAT_COMPLETIONS:
        parts: list[str] = []
        size = 0
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            content = _content_text(message.get("content", ""))
            text = f"{message.get('role', '')}{_ROLE_END}{content}"
            parts.append(text)
            parts.append(_MESSAGE_END)
            size += len(text) + 1
            if size >= limit:
                break
        return "".join(parts)[:limit]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:limit]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return str(prompt[0])[:limit]  # a batch: the first prompt decides
    if prompt is None:
        return _content_text(body.get("input", ""))[:limit]  # embeddings
    return _content_text(prompt)[:limit]  # token ids


def block_hashes(model: str, text: str, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """The chained hashes of ``text``'s full blocks, seeded by ``model``."""
    data = text.encode("utf-8", "surrogatepass")
    blocks = min(len(data) // block_chars, max_blocks)
    digest = blake2b(model.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    out: list[int] = []
    for start in range(0, blocks * block_chars, block_chars):
        digest = blake2b(digest + data[start : start + block_chars], digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
    return tuple(out)


@runtime_checkable
class PrefixObserver(Protocol):
    """Where the prefix scorer reports (the EPP's metrics, as the reference names them)."""

    def prefix_hit_ratio_observed(self, ratio: float) -> None: ...

    def track_prefix_index(self, size: Callable[[], float]) -> None: ...


class PrefixIndex:
    """Which endpoint holds which block hashes: an LRU per endpoint, bounded in all.

    ``capacity`` gives each endpoint's LRU size in blocks. ``holders`` maps a hash to the
    endpoints holding it, so matching walks a prompt's blocks once for all candidates.
    """

    __slots__ = ("_holders", "_lru")

    def __init__(self) -> None:
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[str]] = {}

    @property
    def size(self) -> int:
        """Entries held, over every endpoint."""
        return sum(len(lru) for lru in self._lru.values())

    def insert(self, endpoint: str, hashes: Iterable[int], capacity: int) -> None:
        """``endpoint`` now caches ``hashes`` (most recent last); evict past ``capacity``."""
        lru = self._lru.get(endpoint)
        if lru is None:
            lru = self._lru[endpoint] = OrderedDict()
        holders = self._holders
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            owners = holders.get(h)
            if owners is None:
                holders[h] = {endpoint}
            else:
                owners.add(endpoint)
        while len(lru) > capacity:
            evicted, _ = lru.popitem(last=False)
            self._drop_holder(evicted, endpoint)

    def held(self, h: int) -> bool:
        """Whether any endpoint holds block ``h``."""
        return h in self._holders

    def match(self, hashes: Sequence[int], endpoints: Sequence[str]) -> list[int]:
        """For each endpoint, how many of ``hashes`` it holds as a leading run."""
        matched = dict.fromkeys(endpoints, 0)
        holders = self._holders
        first = holders.get(hashes[0]) if hashes else None
        if not first:
            return [0] * len(endpoints)
        # Walk from the first block's holders among the candidates: work in proportion to the
        # endpoints holding the prefix, not to the pool (every other endpoint matched 0).
        remaining = {e for e in first if e in matched}
        for i in range(1, len(hashes)):
            if not remaining:
                break
            owners = holders.get(hashes[i])
            still = remaining & owners if owners else set()
            for gone in remaining - still:
                matched[gone] = i
            remaining = still
        else:
            for endpoint in remaining:
                matched[endpoint] = len(hashes)
        return list(map(matched.__getitem__, endpoints))

    def leading_holders(self, hashes: Sequence[int], limit: int, rng: Random) -> set[str]:
        """Up to ``limit`` endpoints holding the longest leading run of ``hashes``, then the
        next longest, and so on (drawn at random within a run when it has more holders).

        For a sampled pool (``candidate-sampler``), so it never costs a pass over the pool. A
        block's hash covers every block before it, and a server's cache evicts a prefix's
        deepest blocks first, so the holders of a deeper block hold the shallower ones: the
        scan goes from the deepest block up and stops once ``limit`` endpoints are found."""
        holders = self._holders
        found: set[str] = set()
        for depth in range(len(hashes) - 1, -1, -1):
            owners = holders.get(hashes[depth])
            if not owners:
                continue
            new = owners - found if found else owners
            room = limit - len(found)
            if len(new) > room:
                found.update(rng.sample(sorted(new), room))
            else:
                found.update(new)
            if len(found) >= limit:
                break
        return found

    def purge(self, keep: frozenset[str]) -> None:
        """Forget every endpoint not in ``keep`` (it left the pool)."""
        for endpoint in [e for e in self._lru if e not in keep]:
            for h in self._lru.pop(endpoint):
                self._drop_holder(h, endpoint)

    def _drop_holder(self, h: int, endpoint: str) -> None:
        owners = self._holders.get(h)
        if owners is not None:
            owners.discard(endpoint)
            if not owners:
                del self._holders[h]
