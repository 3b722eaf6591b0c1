"""Deterministic placement: where a prefix or a session no endpoint holds yet should go.

Every EPP replica (and worker) learns its prefix index and session map from its own decisions
only. If each placed a new prefix on whichever endpoint looked least loaded to it, replicas
would scatter one prefix over several endpoints and none would hold it well. Placing it by a
function of the prefix's hash and the candidate endpoints instead makes every replica send a
new prefix to the same endpoint, so the indexes they learn apart converge without talking.

The function is rendezvous hashing (highest random weight): each candidate gets the weight
``mix(key ^ seed(endpoint))`` and the highest wins. Combined with the load bound that runs
before it (``bounded-load-filter`` removes every endpoint past ``max(factor x mean, min +
slack)``), this is consistent hashing with bounded loads: when the preferred endpoint is full,
the key goes to its next-highest endpoint, the same one on every replica whose view of load
agrees. Endpoints joining or leaving move only the keys whose winner they are.

Hashes are stable across processes (BLAKE2b and a fixed integer mix, never Python's salted
``hash``), so replicas started separately agree.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

_MASK = (1 << 64) - 1
_SEEDS_LIMIT = 65_536  # endpoints whose seed is cached (far more than any pool)
RING_CHOICES = 4  # endpoints of a key's place on the ring a sampled pool keeps, in walk order


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text``, the same in every process (for session ids)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _mix(value: int) -> int:
    """splitmix64's finaliser: spreads every input bit over the output."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class Placement:
    """Rendezvous hashing over endpoints named ``host:port``; seeds are cached."""

    __slots__ = ("_seeds",)

    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}

    def _seed(self, hostport: str) -> int:
        seed = self._seeds.get(hostport)
        if seed is None:
            if len(self._seeds) >= _SEEDS_LIMIT:
                self._seeds.clear()
            seed = self._seeds[hostport] = stable_hash(hostport)
        return seed

    def pick(self, key: int, hostports: Sequence[str]) -> int:
        """The index in ``hostports`` where ``key`` goes (``hostports`` must not be empty)."""
        key &= _MASK
        best, best_weight = 0, -1
        for i, hostport in enumerate(hostports):
            weight = _mix(key ^ self._seed(hostport))
            if weight > best_weight:
                best, best_weight = i, weight
        return best

    def place(self, key: int, walk: Sequence[str] | None, hostports: Sequence[str]) -> int | None:
        """Where a key no endpoint holds goes among the candidates ``hostports``: a sampled
        pool places on the ring (``walk``, the key's ring walk, taken among the candidates so
        that replicas agree), a pool scored whole by rendezvous over the candidates."""
        return self.pick(key, hostports) if walk is None else first_present(walk, hostports)


class PlacementRing:
    """A consistent-hash ring over a pool's endpoints, for pools too large to weigh every
    endpoint per request (``candidate-sampler``): ``walk(key, n)`` names the first ``n``
    distinct endpoints clockwise from ``key`` in O(log pool + n), the same on every replica.

    Each endpoint sits at ``points`` positions (``mix(seed ^ i)``), which evens out the share
    of keys each owns. The ring follows the pool incrementally (an endpoint joining or leaving
    inserts or removes its own points), and is built only when first walked.
    """

    __slots__ = ("_built", "_hostports", "_points", "_positions")

    def __init__(self, points: int = 32) -> None:
        self._points = points
        self._hostports: frozenset[str] = frozenset()
        self._positions: list[tuple[int, str]] = []  # sorted
        self._built = False

    def __len__(self) -> int:
        return len(self._hostports)

    def _points_of(self, hostport: str) -> list[tuple[int, str]]:
        seed = stable_hash(hostport)
        return [(_mix(seed ^ i), hostport) for i in range(self._points)]

    def update(self, hostports: frozenset[str]) -> None:
        """Follow the pool: ``hostports`` are its endpoints now."""
        old, self._hostports = self._hostports, hostports
        if not self._built:
            return
        gone, new = old - hostports, hostports - old
        if len(gone) + len(new) > len(hostports) // 4:  # cheaper to start over
            self._built = False
            self._positions = []
            return
        positions = self._positions
        for hostport in gone:
            for point in self._points_of(hostport):
                i = bisect.bisect_left(positions, point)
                if i < len(positions) and positions[i] == point:
                    del positions[i]
        for hostport in new:
            for point in self._points_of(hostport):
                bisect.insort(positions, point)

    def build(self) -> None:
        """Place every endpoint's points now (else the first ``walk`` does)."""
        if not self._built:
            self._positions = sorted(p for h in self._hostports for p in self._points_of(h))
            self._built = True

    def walk(self, key: int, count: int, accept: Callable[[str], bool] | None = None) -> list[str]:
        """Up to ``count`` distinct endpoints, clockwise from ``key``'s place on the ring;
        with ``accept``, only those it accepts (the candidates of a request: replicas given
        the same candidates then agree even when these are a part of the pool)."""
        if count <= 0:
            return []
        self.build()
        positions = self._positions
        size = len(positions)
        start = bisect.bisect_left(positions, (key & _MASK,))
        out: list[str] = []
        seen: set[str] = set()
        for step in range(size):
            hostport = positions[(start + step) % size][1]
            if hostport in seen:
                continue
            seen.add(hostport)
            if accept is None or accept(hostport):
                out.append(hostport)
                if len(out) == count:
                    break
            if len(seen) == len(self._hostports):
                break
        return out


class RingWalk(Protocol):
    """Walks a consistent-hash ring: up to ``count`` distinct endpoints from ``key``'s place."""

    def walk(self, key: int, count: int) -> list[str]: ...


class RingView:
    """A ring walked among one request's candidates only (what scorers get to ``preferred``)."""

    __slots__ = ("_accept", "_ring")

    def __init__(self, ring: PlacementRing, accept: Callable[[str], bool]) -> None:
        self._ring = ring
        self._accept = accept

    def walk(self, key: int, count: int) -> list[str]:
        return self._ring.walk(key, count, self._accept)


def first_present(order: Sequence[str], hostports: Sequence[str]) -> int | None:
    """The index in ``hostports`` of the first of ``order`` (a ring walk) found there."""
    where = {hostport: i for i, hostport in enumerate(hostports)}
    for hostport in order:
        i = where.get(hostport)
        if i is not None:
            return i
    return None


class RecentShares:
    """How much each endpoint was given lately, to bound a choice by: new prefixes for
    placement (below), all routed requests for ``bounded-share-filter``.

    Rendezvous hashing alone spreads keys as a multinomial: 64 prefixes over 4 endpoints leave
    the busiest with about 20 where the mean is 16, and when every prefix draws alike that
    endpoint carries a quarter more load for as long as its prefixes live. Placing a new prefix
    only among the endpoints within ``slack`` of the mean share (consistent hashing with bounded
    loads, the load being the prefixes placed) holds the spread to ``slack``, as the SGLang
    router's "smallest tree first" does; the hash still decides among them, so replicas with
    similar views agree. Counts decay by ``1 - decay`` per addition, so the bound follows what
    the endpoints hold now, not a prefix placed an hour ago. One float per endpoint in the pool.
    """

    __slots__ = ("_counts", "_decay", "_unit", "slack")

    def __init__(self, slack: float = 0.1, decay: float = 1.0 / 256) -> None:
        self.slack = slack
        self._decay = decay
        self._counts: dict[str, float] = {}
        self._unit = 1.0  # the weight of a placement now: grows instead of decaying the others

    def eligible(self, hostports: Sequence[str]) -> list[int]:
        """The indexes in ``hostports`` of those a new prefix may go to: under ``1 + slack``
        times the candidates' mean share once it is placed (never empty: the least-placed
        endpoint is always under it)."""
        counts = [self._counts.get(h, 0.0) for h in hostports]
        if not counts:
            return []
        bound = (1.0 + self.slack) * (sum(counts) + self._unit) / len(counts)
        return [i for i, c in enumerate(counts) if c < bound]

    def add(self, hostport: str) -> None:
        """``hostport`` was given one more (a new prefix, a request)."""
        self._unit /= 1.0 - self._decay
        if self._unit > 1e12:  # rescale before the floats lose their resolution
            self._counts = {h: c / self._unit for h, c in self._counts.items()}
            self._unit = 1.0
        self._counts[hostport] = self._counts.get(hostport, 0.0) + self._unit

    def purge(self, keep: frozenset[str]) -> None:
        """Forget the endpoints that left the pool."""
        for gone in [h for h in self._counts if h not in keep]:
            del self._counts[gone]
