"""Who may read the metrics port: the ``Authorizer`` the server asks about each request.

The server takes the bearer token from ``Authorization`` (no token: 401 without asking) and
calls ``authorize(token, path)``, which answers an ``AccessDecision`` (200, 401 or 403) or
raises ``AccessReviewError`` when it cannot decide now (the port answers 503: fail closed).
Two implementations:

- ``StaticTokens`` (``--metrics-token-file``): the token must equal one line of the file,
  compared in constant time (SHA-256 digests of equal length, ``hmac.compare_digest`` against
  every line, so neither the matching line nor a token's length shows in the timing); the
  file is re-read when its inode, size or mtime changes, and a missing or empty file refuses
  everyone (503, logged once per change).
- ``CachedReviews`` (Kubernetes): wraps a review function (``KubernetesAccessReviewer.review``,
  a TokenReview and a SubjectAccessReview) with a bounded cache of answers keyed by a hash of
  the token and the path (allowed answers for ``allow_ttl``, 401/403 for ``deny_ttl``, least
  recently used dropped past ``max_entries``), single flight (concurrent requests with the same
  token and path share one review), a cap on reviews in flight, and one log line per change
  of the API's reachability. Failures are never cached: the next request asks again.

With auth off the server has no authorizer at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import structlog

from endpoint_picker.errors import AccessReviewError, ConfigError
from endpoint_picker.types import AccessDecision

log = structlog.get_logger(__name__)

Review = Callable[[str, str], Awaitable[AccessDecision]]


class Authorizer(Protocol):
    async def authorize(self, token: str, path: str) -> AccessDecision:
        """May the holder of ``token`` GET ``path``? ``AccessReviewError``: cannot tell now."""
        ...


class _Trouble:
    """A problem that is logged when it starts, changes or ends, never once per request."""

    def __init__(self, failing: str, recovered: str) -> None:
        self._failing = failing
        self._recovered = recovered
        self.current: str | None = None

    def set(self, problem: str | None) -> None:
        if problem == self.current:
            return
        if problem is not None:
            log.warning(self._failing, error=problem)
        else:
            log.info(self._recovered)
        self.current = problem


class StaticTokens:
    """``--metrics-token-file``: one or more tokens, one per line (blank lines ignored)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stamp: tuple[int, int, int] | None = None
        self._digests: tuple[bytes, ...] = ()  # SHA-256 of each token
        self._trouble = _Trouble(
            "metrics port: no usable token file; answering 503",
            "metrics port: the token file holds tokens again",
        )

    def load(self) -> None:
        """At start: ``ConfigError`` unless the file holds a token (a typo fails fast)."""
        self._refresh()
        if self._trouble.current is not None:
            raise ConfigError(self._trouble.current, "--metrics-token-file")

    async def authorize(self, token: str, path: str) -> AccessDecision:
        self._refresh()
        if self._trouble.current is not None:
            raise AccessReviewError(self._trouble.current)
        given = hashlib.sha256(token.encode()).digest()
        matched = False
        for expected in self._digests:  # every line compared: no early exit either
            matched |= hmac.compare_digest(expected, given)
        if matched:
            return AccessDecision(200, user="token-file")
        return AccessDecision(401, "the token is not in --metrics-token-file")

    def _refresh(self) -> None:
        try:
            st = self._path.stat()
        except OSError as exc:
            self._stamp, self._digests = None, ()
            self._trouble.set(f"cannot read {self._path}: {exc.strerror}; no token is accepted")
            return
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        try:
            text = self._path.read_bytes()
        except OSError as exc:
            self._trouble.set(f"cannot read {self._path}: {exc.strerror}; no token is accepted")
            return
        self._stamp = stamp
        tokens = [line.strip() for line in text.splitlines() if line.strip()]
        self._digests = tuple(hashlib.sha256(t).digest() for t in tokens)
        if not self._digests:
            self._trouble.set(f"{self._path} holds no token; no token is accepted")
        else:
            self._trouble.set(None)
            log.info("metrics port: tokens loaded", path=str(self._path), count=len(tokens))


def _key(token: str, path: str) -> bytes:
    """What the cache is keyed by: a digest, so the tokens themselves are not kept."""
    return hashlib.sha256(b"%s\x00%s" % (token.encode(), path.encode())).digest()


class CachedReviews:
    """A review function behind a TTL cache and single flight (see the module doc)."""

    def __init__(
        self,
        review: Review,
        *,
        allow_ttl: float,
        deny_ttl: float,
        max_entries: int,
        max_concurrent: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._review = review
        self._allow_ttl = allow_ttl
        self._deny_ttl = deny_ttl
        self._max_entries = max_entries
        self._clock = clock
        self._answers: OrderedDict[bytes, tuple[float, AccessDecision]] = OrderedDict()
        self._flights: dict[bytes, asyncio.Task[AccessDecision]] = {}
        self._slots = asyncio.Semaphore(max_concurrent)
        self._trouble = _Trouble(
            "metrics port: cannot check tokens with the Kubernetes API; answering 503",
            "metrics port: the Kubernetes API checks tokens again",
        )
        self.reviews = 0  # reviews asked (tests, logs)

    def __len__(self) -> int:
        return len(self._answers)

    async def authorize(self, token: str, path: str) -> AccessDecision:
        key = _key(token, path)
        cached = self._answers.get(key)
        if cached is not None:
            expires, decision = cached
            if self._clock() < expires:
                self._answers.move_to_end(key)
                return decision
            del self._answers[key]
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.create_task(self._ask(key, token, path), name="metrics-token-review")
            flight.add_done_callback(_retrieve)
            self._flights[key] = flight
        # shielded: a client that goes away does not cancel the others' review
        return await asyncio.shield(flight)

    async def _ask(self, key: bytes, token: str, path: str) -> AccessDecision:
        try:
            async with self._slots:
                self.reviews += 1
                decision = await self._review(token, path)
        except AccessReviewError as exc:
            self._trouble.set(str(exc))
            raise
        finally:
            del self._flights[key]
        self._trouble.set(None)
        if decision.status == 403:  # a known user lacks the RBAC rule: worth an operator's look
            log.info("metrics port: forbidden", path=path, user=decision.user, why=decision.reason)
        elif not decision.allowed:
            log.debug("metrics port: token refused", path=path, why=decision.reason)
        ttl = self._allow_ttl if decision.allowed else self._deny_ttl
        self._answers[key] = (self._clock() + ttl, decision)
        while len(self._answers) > self._max_entries:
            self._answers.popitem(last=False)
        return decision

    async def close(self) -> None:
        """Cancel the reviews in flight (the app stops)."""
        flights = list(self._flights.values())
        for flight in flights:
            flight.cancel()
        await asyncio.gather(*flights, return_exceptions=True)


def _retrieve(task: asyncio.Task[AccessDecision]) -> None:
    """Mark a failed review's exception as seen: every waiter may have gone away."""
    if not task.cancelled():
        task.exception()
