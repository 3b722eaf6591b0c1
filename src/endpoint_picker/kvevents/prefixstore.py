"""The tokens of prompt texts already seen, by text prefix, so a prompt that shares a long
prefix with an earlier one (a system prompt, a conversation's earlier turns) tokenizes only its
new tail (llm-d's "prefix store", ``pkg/tokenization/prefixstore``, by behaviour).

The text is cut into chunks of ``chunk_chars`` characters; each full chunk is keyed by a keyed
hash chained over the chunks before it (and a root naming the tokenizer and whether special
tokens are added), and holds the tokens whose end offset falls inside it. A later prompt walks
its own chunks' keys: the leading chunks found give its leading tokens.

The tokens near the end of the matched text are not trusted: the text that followed them may
differ (a word that went on), and BPE merges across it. So ``tokenize`` re-tokenizes from a
token boundary ``OVERLAP + GUARD`` characters before the end of the match, and splices there
only when the new tokens and the stored ones agree, boundary and ids, over the stretch that
ends ``GUARD`` characters before the end of the match, skipping the new run's first token (it
lacks its left context: a prefix space, a word cut). Without such agreement, the whole prompt
is tokenized as if nothing were stored. llm-d instead takes the stored tokens alone (without
the tail) once 80% of the text matched; this is exact where llm-d approximates.

Bounded: at most ``max_chunks`` chunks (LRU), each holding the tokens of ``chunk_chars``
characters. The keys are hashes keyed by a random per-process secret, so a client cannot craft
text to collide with another prompt's entries.
"""

from __future__ import annotations

import os
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import blake2b

from tokenizers import Encoding

from endpoint_picker.kvevents.wire import TOKEN_ARRAY

GUARD = 32  # characters before a text's end (a match's or a cut's) whose tokens may change
OVERLAP = 64  # characters re-tokenized before GUARD, to find where the stored tokens agree


@dataclass(frozen=True, slots=True)
class Tokens:
    """Token ids with their character offsets in the text (``ends`` never decrease)."""

    ids: array[int]
    starts: array[int]
    ends: array[int]

    def __len__(self) -> int:
        return len(self.ids)

    def head(self, count: int) -> Tokens:
        return Tokens(self.ids[:count], self.starts[:count], self.ends[:count])

    def tail(self, first: int, shift: int = 0) -> Tokens:
        starts, ends = self.starts[first:], self.ends[first:]
        if shift:
            starts = array(TOKEN_ARRAY, [s + shift for s in starts])
            ends = array(TOKEN_ARRAY, [e + shift for e in ends])
        return Tokens(self.ids[first:], starts, ends)

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(self.ids + other.ids, self.starts + other.starts, self.ends + other.ends)

    def before(self, limit: int) -> Tokens:
        """The tokens that end at or before character ``limit``."""
        return self.head(bisect_right(self.ends, limit))


# text, whether to add special tokens -> its tokens and the special tokens appended after them
Encode = Callable[[str, bool], tuple[Tokens, "array[int]"]]


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A prompt's token ids, all of them (``complete``) or its leading ones only; ``store``:
    whether the caller should tokenize it whole and ``add`` it (its continuation past the
    stored chunks was seen before)."""

    ids: array[int]
    complete: bool
    store: bool = False


EMPTY = Tokens(array(TOKEN_ARRAY), array(TOKEN_ARRAY), array(TOKEN_ARRAY))


def from_encoding(encoding: Encoding, text_chars: int) -> tuple[Tokens, array[int]]:
    """The encoding's tokens, and apart the special tokens a post-processor appended (an EOS:
    no offsets, at the end), which belong to no chunk of text."""
    ids, offsets, special = encoding.ids, encoding.offsets, encoding.special_tokens_mask
    count = len(ids)
    while count and text_chars and special[count - 1] and offsets[count - 1] == (0, 0):
        count -= 1
    starts = array(TOKEN_ARRAY, [s for s, _ in offsets[:count]])
    ends = array(TOKEN_ARRAY, [e for _, e in offsets[:count]])
    return Tokens(array(TOKEN_ARRAY, ids[:count]), starts, ends), array(TOKEN_ARRAY, ids[count:])


def splice(stored: Tokens, fresh: Tokens, matched: int) -> tuple[int, int] | None:
    """Where ``stored`` (tokens of the text up to character ``matched``, from another prompt)
    and ``fresh`` (this text tokenized from a boundary of ``stored`` on) agree: the prompt's
    tokens are ``stored``'s before index k, then ``fresh``'s from index j; (k, j), or None
    when they never agree."""
    limit = matched - GUARD
    starts = stored.starts
    for j in range(1, len(fresh)):
        start = fresh.starts[j]
        if start > limit:
            return None
        if j and fresh.starts[j - 1] == start:  # inside a character split into bytes
            continue
        k = bisect_left(starts, start)
        if k >= len(stored) or starts[k] != start or (k and stored.ends[k - 1] > start):
            continue
        compared = 0
        while (
            k + compared < len(stored)
            and j + compared < len(fresh)
            and stored.ends[k + compared] <= limit
            and stored.ids[k + compared] == fresh.ids[j + compared]
            and stored.starts[k + compared] == fresh.starts[j + compared]
            and stored.ends[k + compared] == fresh.ends[j + compared]
        ):
            compared += 1
        if compared and (k + compared == len(stored) or stored.ends[k + compared] > limit):
            return k, j
    return None


class PrefixStore:
    """Chunks of text -> the tokens that end in them, LRU, at most ``max_chunks``."""

    __slots__ = ("_chunks", "_keyed", "_seen", "chunk_chars", "hits", "max_chunks", "misses")

    def __init__(self, chunk_chars: int = 256, max_chunks: int = 32_768) -> None:
        if chunk_chars <= GUARD + OVERLAP:
            raise ValueError(f"chunk_chars must be over {GUARD + OVERLAP}")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self._keyed = blake2b(key=os.urandom(32), digest_size=16)  # copied per hash
        self._chunks: OrderedDict[bytes, Tokens] = OrderedDict()
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # the doorkeeper, LRU
        self.hits = 0  # prompts that found a stored prefix (counted by ``tokenize``'s caller)
        self.misses = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def _second_sight(self, key: bytes) -> bool:
        """Whether a prompt went on past the stored chunks with this chunk (``key``) before:
        a prefix seen once is not worth tokenizing whole (most prompts never come again: it
        would double the tokenizing), one seen twice is (a doorkeeper, as TinyLFU's)."""
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > self.max_chunks:
            self._seen.popitem(last=False)
        return False

    def keys(self, root: str, text: str) -> list[bytes]:
        """The chained keys of ``text``'s full chunks, from ``root`` (the tokenizer and its
        special-tokens flag). Safe on a thread: it reads nothing that changes."""
        return self._chain(self._root(root), text, 0)

    def _root(self, root: str) -> bytes:
        state = self._keyed.copy()
        state.update(root.encode("utf-8", "surrogatepass"))
        return state.digest()

    def _chain(self, digest: bytes, text: str, first: int) -> list[bytes]:
        size, fresh = self.chunk_chars, self._keyed.copy
        out: list[bytes] = []
        for start in range(first * size, len(text) - size + 1, size):
            state = fresh()
            state.update(digest)
            state.update(text[start : start + size].encode("utf-8", "surrogatepass"))
            digest = state.digest()
            out.append(digest)
        return out

    def lookup(self, root: str, text: str) -> tuple[list[bytes], list[Tokens]]:
        """The keys of ``text``'s leading chunks, up to and with the first one not stored,
        and the stored ones' tokens (each chunk's); keys are hashed only as far as found."""
        size, fresh = self.chunk_chars, self._keyed.copy
        digest = self._root(root)
        keys: list[bytes] = []
        found: list[Tokens] = []
        chunks = self._chunks
        for start in range(0, len(text) - size + 1, size):
            state = fresh()
            state.update(digest)
            state.update(text[start : start + size].encode("utf-8", "surrogatepass"))
            digest = state.digest()
            keys.append(digest)
            tokens = chunks.get(digest)
            if tokens is None:
                break
            chunks.move_to_end(digest)
            found.append(tokens)
        return keys, found

    def add(self, keys: list[bytes], tokens: Tokens, first: int = 0) -> None:
        """Keep ``tokens`` (a whole text's, special tokens first) by the chunks of ``keys``
        from ``first`` on; the chunks before are stored already."""
        if not self.max_chunks:
            return
        size = self.chunk_chars
        lo = bisect_right(tokens.ends, first * size) if first else 0
        for index in range(first, len(keys)):
            hi = bisect_right(tokens.ends, (index + 1) * size, lo)
            self._chunks[keys[index]] = Tokens(
                tokens.ids[lo:hi], tokens.starts[lo:hi], tokens.ends[lo:hi]
            )
            self._chunks.move_to_end(keys[index])
            lo = hi
        while len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)

    def tokenize(
        self,
        encode: Encode,
        root: str,
        text: str,
        special: bool,
        budget: int,
        appended: array[int],
    ) -> Tokenized:
        """``text``'s tokens, tokenizing at most about ``budget`` characters of it: the stored
        prefix and the tail past it when the tail fits, else the leading ``budget``
        characters' tokens only (``complete`` false: the caller tokenizes the whole text
        elsewhere and ``add``s it). ``appended``: the special tokens the tokenizer puts after
        a text when ``special`` (an EOS; usually none)."""
        keys, found = self.lookup(root, text)
        held = len(found)
        if held:
            matched = held * self.chunk_chars
            # offsets are needed near the end of the match only: the last two chunks'
            near = found[-2:]
            stored = near[0] + near[1] if len(near) == 2 else near[0]
            cut = bisect_right(stored.ends, matched - GUARD - OVERLAP)
            if cut:
                start = stored.ends[cut - 1]
                end = min(len(text), max(start + budget, matched))
                fresh = encode(text[start:end], False)[0].tail(0, start)
                joint = splice(stored, fresh, matched)
                if joint is not None:
                    self.hits += 1
                    k, j = joint
                    ids = array(TOKEN_ARRAY, b"".join(t.ids.tobytes() for t in found[:-2]))
                    ids += stored.ids[:k]
                    if end < len(text):
                        ids += fresh.ids[j : bisect_right(fresh.ends, end - GUARD)]
                        return Tokenized(ids, False, self._second_sight(keys[-1]))
                    ids += fresh.ids[j:]
                    keys += self._chain(keys[-1], text, len(keys))  # the chunks not hashed
                    self.add(keys, fresh.tail(j), held)
                    return Tokenized(ids + appended if special else ids, True)
        self.misses += 1
        if len(text) <= budget:
            tokens, after = encode(text, special)
            self.add(self.keys(root, text), tokens)
            return Tokenized(tokens.ids + after, True)
        tokens, _ = encode(text[:budget], special)
        first = keys[-1] if keys else self._root(root)
        return Tokenized(tokens.before(budget - GUARD).ids, False, self._second_sight(first))
