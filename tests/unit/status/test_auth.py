"""The metrics port's authorizers: static tokens from a file, and cached Kubernetes reviews."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from endpoint_picker.errors import AccessReviewError, ConfigError
from endpoint_picker.status.auth import CachedReviews, StaticTokens
from endpoint_picker.status.server import bearer_token
from endpoint_picker.types import AccessDecision

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc.def", "abc.def"),
        ("bearer  abc ", "abc"),
        ("BEARER x+y/z=", "x+y/z="),
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer   ", None),
        ("Basic dXNlcjpwYXNz", None),
        ("abc", None),
    ],
)
def test_bearer_token_is_read_from_the_authorization_header(
    header: str | None, token: str | None
) -> None:
    """Only the Bearer scheme (any case) with a token counts."""
    assert bearer_token(header) == token


# -- StaticTokens ---------------------------------------------------------------------------------


def write(path: Path, text: str) -> None:
    """Replace the file's content with a new mtime (a rewrite within one clock tick still counts
    when the size differs; the tests also bump the mtime so it never depends on that)."""
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


async def test_static_tokens_accept_any_line_of_the_file_and_nothing_else(tmp_path: Path) -> None:
    """Every non-blank line is a token (surrounding spaces ignored); anything else is 401; the
    comparison is hmac.compare_digest against every line."""
    path = tmp_path / "tokens"
    write(path, "first-token\n\n  second-token  \n")
    tokens = StaticTokens(path)
    tokens.load()
    for good in ("first-token", "second-token"):
        assert (await tokens.authorize(good, "/metrics")).status == 200
    for bad in ("first", "first-token\n", "second-token ", "x", "first-tokenx"):
        assert (await tokens.authorize(bad, "/metrics")).status == 401, bad


async def test_static_tokens_are_compared_in_constant_time_against_every_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check goes through hmac.compare_digest for each configured token, even once one
    matched, on SHA-256 digests (equal lengths), so the time taken tells neither which line
    matched nor how long a token is."""
    path = tmp_path / "tokens"
    write(path, "a\nb\nc\n")
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    tokens = StaticTokens(path)
    tokens.load()
    assert (await tokens.authorize("a", "/")).allowed
    digest = {t: hashlib.sha256(t).digest() for t in (b"a", b"b", b"c")}
    assert compared == [
        (digest[b"a"], digest[b"a"]),
        (digest[b"b"], digest[b"a"]),
        (digest[b"c"], digest[b"a"]),
    ]


async def test_static_tokens_follow_the_file_when_it_changes(tmp_path: Path) -> None:
    """A rotated file takes effect at the next request: the new token in, the old one out."""
    path = tmp_path / "tokens"
    write(path, "old-token\n")
    tokens = StaticTokens(path)
    tokens.load()
    assert (await tokens.authorize("old-token", "/metrics")).allowed
    write(path, "new-token\n")
    assert (await tokens.authorize("new-token", "/metrics")).allowed
    assert (await tokens.authorize("old-token", "/metrics")).status == 401


@pytest.mark.parametrize("problem", ["missing", "empty", "blank lines"])
async def test_static_tokens_fail_closed_on_a_missing_or_empty_file_and_recover(
    tmp_path: Path, problem: str
) -> None:
    """At start a missing or empty file is a ConfigError; later it refuses every token with
    AccessReviewError (503), logged once however many requests come, and a file with a token
    again is used at once (logged)."""
    path = tmp_path / "tokens"
    write(path, "token\n")
    tokens = StaticTokens(path)
    tokens.load()
    if problem == "missing":
        path.unlink()
    else:
        write(path, "" if problem == "empty" else "\n  \n")
    with pytest.raises(ConfigError, match="--metrics-token-file"):
        StaticTokens(path).load()
    with capture_logs() as logs:
        for _ in range(5):
            with pytest.raises(AccessReviewError, match="no token is accepted"):
                await tokens.authorize("token", "/metrics")
        write(path, "token\n")
        assert (await tokens.authorize("token", "/metrics")).allowed
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert len(warnings) == 1, logs
    assert any(e["event"] == "metrics port: the token file holds tokens again" for e in logs)


# -- CachedReviews --------------------------------------------------------------------------------


class FakeReviews:
    """A review function with scripted answers, counting calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.answers: dict[str, AccessDecision] = {}
        self.failing: str | None = None
        self.delay = 0.0

    async def review(self, token: str, path: str) -> AccessDecision:
        self.calls.append((token, path))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.failing is not None:
            raise AccessReviewError(self.failing)
        return self.answers.get(token, AccessDecision(401, "unknown token"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cached(reviews: FakeReviews, clock: Clock, max_entries: int = 100) -> CachedReviews:
    return CachedReviews(
        reviews.review, allow_ttl=60.0, deny_ttl=10.0, max_entries=max_entries, clock=clock
    )


async def test_answers_are_reused_for_their_ttl_allowed_longer_than_denied() -> None:
    """Allowed answers are reused for 60 s, 401 and 403 for 10 s, per (token, path)."""
    reviews, clock = FakeReviews(), Clock()
    reviews.answers = {"ok": AccessDecision(200), "no": AccessDecision(403, "no rule")}
    auth = cached(reviews, clock)
    for _ in range(3):
        assert (await auth.authorize("ok", "/metrics")).allowed
        assert (await auth.authorize("no", "/metrics")).status == 403
        assert (await auth.authorize("bad", "/metrics")).status == 401
    assert len(reviews.calls) == 3
    await auth.authorize("ok", "/api/status")  # another path: its own review
    assert len(reviews.calls) == 4
    clock.now += 10.5  # the denials expired, the allowed answers did not
    await auth.authorize("ok", "/metrics")
    await auth.authorize("no", "/metrics")
    await auth.authorize("bad", "/metrics")
    assert reviews.calls[4:] == [("no", "/metrics"), ("bad", "/metrics")]
    clock.now += 60
    await auth.authorize("ok", "/metrics")
    assert reviews.calls[-1] == ("ok", "/metrics")


async def test_cache_is_bounded_dropping_the_least_recently_used() -> None:
    """Past max_entries the answer used longest ago goes; the cache never holds a token."""
    reviews, clock = FakeReviews(), Clock()
    reviews.answers = {f"t{i}": AccessDecision(200) for i in range(10)}
    auth = cached(reviews, clock, max_entries=3)
    for token in ("t0", "t1", "t2"):
        await auth.authorize(token, "/metrics")
    await auth.authorize("t0", "/metrics")  # t0 used again: t1 is now the oldest
    await auth.authorize("t3", "/metrics")
    assert len(auth) == 3
    calls = len(reviews.calls)
    await auth.authorize("t0", "/metrics")
    assert len(reviews.calls) == calls  # kept
    await auth.authorize("t1", "/metrics")
    assert len(reviews.calls) == calls + 1  # dropped, asked again
    assert all(len(key) == 32 for key in auth._answers)  # SHA-256 digests, not tokens


async def test_concurrent_requests_with_one_token_share_one_review() -> None:
    """100 requests at once with one token and path make one review; all get its answer."""
    reviews, clock = FakeReviews(), Clock()
    reviews.answers = {"ok": AccessDecision(200)}
    reviews.delay = 0.05
    auth = cached(reviews, clock)
    answers = await asyncio.gather(*(auth.authorize("ok", "/metrics") for _ in range(100)))
    assert all(a.allowed for a in answers)
    assert len(reviews.calls) == 1


async def test_a_waiter_that_goes_away_does_not_cancel_the_shared_review() -> None:
    """The first requester cancelled mid-review (its client left): the others still get the
    answer from the same single review."""
    reviews, clock = FakeReviews(), Clock()
    reviews.answers = {"ok": AccessDecision(200)}
    reviews.delay = 0.05
    auth = cached(reviews, clock)
    first = asyncio.create_task(auth.authorize("ok", "/metrics"))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(auth.authorize("ok", "/metrics"))
    await asyncio.sleep(0)
    first.cancel()
    assert (await second).allowed
    assert len(reviews.calls) == 1


async def test_failures_are_not_cached_and_are_logged_once_per_change() -> None:
    """While the API cannot review every request asks again and fails (503 at the server);
    the outage is logged once however many requests fail, a different error once more, and
    the recovery once; then answers are cached again."""
    reviews, clock = FakeReviews(), Clock()
    reviews.answers = {"ok": AccessDecision(200)}
    auth = cached(reviews, clock)
    with capture_logs() as logs:
        reviews.failing = "the Kubernetes API is unreachable: ConnectError"
        for _ in range(5):
            with pytest.raises(AccessReviewError):
                await auth.authorize("ok", "/metrics")
        reviews.failing = "the Kubernetes API did not answer within 5s"
        with pytest.raises(AccessReviewError):
            await auth.authorize("ok", "/metrics")
        reviews.failing = None
        for _ in range(3):
            assert (await auth.authorize("ok", "/metrics")).allowed
    assert len(reviews.calls) == 7  # six failures, one review that is then reused
    events = [(e["log_level"], e.get("error")) for e in logs if "Kubernetes" in e["event"]]
    assert events == [
        ("warning", "the Kubernetes API is unreachable: ConnectError"),
        ("warning", "the Kubernetes API did not answer within 5s"),
        ("info", None),
    ]


async def test_close_cancels_reviews_in_flight() -> None:
    """Stopping the app leaves no review task behind."""
    reviews, clock = FakeReviews(), Clock()
    reviews.delay = 10
    auth = cached(reviews, clock)
    waiter = asyncio.create_task(auth.authorize("ok", "/metrics"))
    await asyncio.sleep(0.01)
    await auth.close()
    with pytest.raises(asyncio.CancelledError):
        await waiter
