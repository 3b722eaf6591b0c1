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

import hashlib
from collections.abc import Sequence

_MASK = (1 << 64) - 1
_SEEDS_LIMIT = 65_536  # endpoints whose seed is cached (far more than any pool)


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
