"""The soak's load: seeded request bodies, the open-loop client, and the tally it counts into.

Not ``bench.client``: that one sends a planned list of requests and keeps a record of each
(what a table of percentiles per rate needs). A soak sends for half an hour or more
(hundreds of thousands of requests), so this client makes each body when it is due and keeps
only counts and the current sampling window's latencies; and a share of its clients vanish
mid-request, which ``bench.client`` never does.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from endpoint_picker.bench.prompts import TextSource
from endpoint_picker.bench.stats import percentile

BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ADAPTERS = ("soak-lora-0", "soak-lora-1")
GROUPS = 16
SYSTEM_TOKENS = 256  # 4 blocks of the EPP's prefix index (64 tokens, 256 characters, each)
REQUEST_TIMEOUT = 60.0
KINDS = ("stream", "plain", "vanish-after-first-chunk", "vanish-before-headers")


@dataclass(frozen=True, slots=True)
class Job:
    kind: str
    path: str
    body: bytes


class Mix:
    """Seeded request bodies: completion or chat, base model or adapter, stream or not."""

    def __init__(self, seed: int, vanish: float) -> None:
        self.rng = random.Random(f"{seed}:soak")
        text = TextSource(random.Random(f"{seed}:text"))
        self.systems = [text.text(f"System prompt {g}: ", SYSTEM_TOKENS) for g in range(GROUPS)]
        self.text = text
        self.vanish = vanish
        self.count = 0

    def next(self) -> Job:
        rng = self.rng
        self.count += 1
        if rng.random() < self.vanish:
            kind = KINDS[2] if rng.random() < 0.5 else KINDS[3]
        else:
            kind = KINDS[0] if rng.random() < 0.5 else KINDS[1]
        model = BASE_MODEL if rng.random() < 0.8 else rng.choice(ADAPTERS)
        system = rng.choice(self.systems)
        question = self.text.text(f"Question {self.count}: ", rng.randint(8, 40))
        body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(16, 64)}
        if kind != KINDS[1]:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        if rng.random() < 0.5:
            path = "/v1/completions"
            body["prompt"] = f"{system} {question}"
        else:
            path = "/v1/chat/completions"
            body["messages"] = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
        return Job(kind, path, orjson.dumps(body))


@dataclass
class Tally:
    """What the client saw: totals, and the figures of the current sampling window."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    done: int = 0  # complete 200s
    lag_sum: float = 0.0
    lag_max: float = 0.0
    ttfts: list[float] = field(default_factory=list)  # streamed, whole run (find-max steps)
    # the window since the last sample
    w_done: int = 0
    w_errors: int = 0
    w_sent: int = 0
    w_lag: float = 0.0
    w_ttft: list[float] = field(default_factory=list)
    w_e2e: list[float] = field(default_factory=list)

    def outcome(self, kind: str, status: str, error: str = "") -> None:
        self.outcomes[kind, status] += 1
        if status == "200":
            self.done += 1
            self.w_done += 1
        if status not in ("200", "vanished"):
            self.w_errors += 1
            self.errors[error or f"HTTP {status}"] += 1

    def ok_share(self) -> float:
        """Complete 200s among the requests that were not meant to vanish."""
        kept = [(s, n) for (k, s), n in self.outcomes.items() if not k.startswith("vanish")]
        total = sum(n for _, n in kept)
        return sum(n for s, n in kept if s == "200") / total if total else 0.0

    def window(self, seconds: float) -> dict[str, float]:
        """The window's figures; starts the next window."""
        out = {
            "completed_per_s": self.w_done / seconds,
            "errors": float(self.w_errors),
            "ttft_p50_ms": ms(percentile(self.w_ttft, 50)),
            "ttft_p90_ms": ms(percentile(self.w_ttft, 90)),
            "e2e_p90_ms": ms(percentile(self.w_e2e, 90)),
            "send_lag_ms": self.w_lag / self.w_sent * 1e3 if self.w_sent else math.nan,
        }
        self.w_done = self.w_errors = self.w_sent = 0
        self.w_lag = 0.0
        self.w_ttft, self.w_e2e = [], []
        return out


def ms(seconds: float | None) -> float:
    """Seconds as milliseconds; no value (a percentile of nothing) is NaN in the samples."""
    return math.nan if seconds is None else seconds * 1e3


class Client:
    """Sends jobs to Envoy on an open-loop schedule; counts into a ``Tally``."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url.rstrip("/")
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
        self.rng = random.Random("vanish-delays")

    async def run(self, mix: Mix, rate: float, duration: float, seed: int, tally: Tally) -> None:
        """Poisson arrivals at ``rate`` for ``duration`` seconds; returns when all have ended."""
        loop = asyncio.get_running_loop()
        gaps = random.Random(f"{seed}:arrivals:{rate}")
        start = loop.time()
        at = gaps.expovariate(rate)
        async with asyncio.TaskGroup() as group:
            while at < duration:
                delay = start + at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                group.create_task(self.one(mix.next(), start + at, tally))
                at += gaps.expovariate(rate)

    async def one(self, job: Job, due: float, tally: Tally) -> None:
        lag = max(0.0, asyncio.get_running_loop().time() - due)
        tally.sent += 1
        tally.w_sent += 1
        tally.lag_sum += lag
        tally.w_lag += lag
        tally.lag_max = max(tally.lag_max, lag)
        if job.kind == "vanish-before-headers":
            await self.vanish_early(job, tally)
        else:
            await self.request(job, tally)

    async def request(self, job: Job, tally: Tally) -> None:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        streamed = job.kind != "plain"
        vanish = job.kind == "vanish-after-first-chunk"
        status = "0"
        try:
            async with self.session.post(
                self.url + job.path,
                data=job.body,
                headers={"Content-Type": "application/json"},
                timeout=self.timeout,
            ) as response:
                status = str(response.status)
                if response.status != 200:
                    await response.read()
                    tally.outcome(job.kind, status)
                    return
                if not streamed:
                    answer = orjson.loads(await response.read())
                    if not answer.get("choices"):
                        tally.outcome(job.kind, "200-no-choices")
                        return
                    tally.w_e2e.append(loop.time() - sent)
                    tally.outcome(job.kind, "200")
                    return
                tail, first = b"", True
                async for chunk in response.content.iter_any():
                    if first:
                        first = False
                        if vanish:  # the client is gone: the connection closes unread
                            response.close()
                            tally.outcome(job.kind, "vanished")
                            return
                        ttft = loop.time() - sent
                        tally.ttfts.append(ttft)
                        tally.w_ttft.append(ttft)
                    tail = (tail + chunk)[-64:]
                if b"[DONE]" not in tail:
                    tally.outcome(job.kind, "200-incomplete")
                    return
                tally.w_e2e.append(loop.time() - sent)
                tally.outcome(job.kind, "200")
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
            tally.outcome(job.kind, status if status != "200" else "200-broken", _error(exc))

    async def vanish_early(self, job: Job, tally: Tally) -> None:
        """Send the whole request, then reset the connection before the response headers."""
        head = (
            f"POST {job.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(job.body)}\r\n\r\n"
        ).encode()
        try:
            _, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as exc:
            tally.outcome(job.kind, "0", _error(exc))
            return
        try:
            writer.write(head + job.body)
            await writer.drain()
            await asyncio.sleep(self.rng.uniform(0.0, 0.03))
        finally:
            writer.transport.abort()
        tally.outcome(job.kind, "vanished")


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]
