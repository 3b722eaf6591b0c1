"""Benchmark: where precise-prefix-cache-scorer's time on the request path goes.

Run: ``PYTHONPATH=src:. .venv/bin/python benchmarks/bench_precise_path.py [--hogs 2]``
(a benchmark, not a test). It builds the bench's tokenizer (``epp bench --tokenizer build``)
and the bench's shared-prefix prompts (system prompts of ``--prompt-tokens`` simulator tokens,
a 50-token question each), then on one event loop feeds requests to the scorer at ``--rate``
as the director does, the groups drawn at random, and reports medians and p90s of:

- without the prefix store (``prefixStoreConfig.cacheSize: 0``, the thread path): the time
  from ``prepare`` to the thread starting (the executor's queue, a core), the thread's work
  (tokenize + hash), from its end back to the loop running the result (the hop back), and in
  all; plus the same tokenizing alone, idle, for scale;
- with the store: ``prepare`` on the loop (no thread waited for), for prompts whose prefix
  was stored (hits) and not (misses).

``--hogs N`` keeps N processes spinning meanwhile (the simulated fleet, Envoy and the load
generator fill this machine's cores during ``epp bench``); ``--loop-busy`` milliseconds of
Python run on the loop every 10 ms (the other requests' work, which holds the GIL).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import tempfile
import time
from pathlib import Path

import orjson

from endpoint_picker.bench.prompts import TextSource
from endpoint_picker.bench.tokenizer import build_tokenizer
from endpoint_picker.kvevents.feeds import KVEventsConfig
from endpoint_picker.kvevents.index import BlockHasher, BlockIndex
from endpoint_picker.kvevents.prefixstore import PrefixStore
from endpoint_picker.kvevents.subscriber import KVEventsHub
from endpoint_picker.kvevents.tokens import PromptTokenizer, load_tokenizer
from endpoint_picker.requests import Api, LLMRequest, parse_request
from endpoint_picker.scheduling.plugins.precise import PrecisePrefixCacheScorer


def _hog(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def _line(name: str, values: list[float]) -> str:
    if not values:
        return f"  {name}: none"
    return (f"  {name}: p50 {_pct(values, 0.5):.2f} ms, p90 {_pct(values, 0.9):.2f} ms, "
            f"p99 {_pct(values, 0.99):.2f} ms ({len(values)})")  # fmt: skip


def _scorer(model_path: Path, store: bool) -> PrecisePrefixCacheScorer:
    index = BlockIndex(BlockHasher(16), max_blocks=1_000_000, max_blocks_per_endpoint=250_000)
    hub = KVEventsHub(KVEventsConfig(), index)
    tokenizer = PromptTokenizer({"": load_tokenizer(model_path)})
    return PrecisePrefixCacheScorer(
        hub, tokenizer, max_pending=2, store=PrefixStore() if store else None
    )


async def _lag(until: float, out: list[float]) -> None:
    """How late a 1 ms sleep wakes: what any request arriving then would wait."""
    while time.monotonic() < until:
        start = time.perf_counter()
        await asyncio.sleep(0.001)
        out.append(max(0.0, time.perf_counter() - start - 0.001))


async def _busy_loop(ms: float, until: float) -> None:
    while time.monotonic() < until:
        end = time.perf_counter() + ms / 1000
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0.010)


async def _thread_path(scorer: PrecisePrefixCacheScorer, request: LLMRequest) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    marks: dict[str, float] = {}
    start = time.perf_counter()
    work = scorer.prepare(request)
    if work is None:
        return {"total": time.perf_counter() - start}

    def on_thread():  # type: ignore[no-untyped-def]
        marks["thread_start"] = time.perf_counter()
        finish = work()
        marks["thread_end"] = time.perf_counter()
        return finish

    finish = await loop.run_in_executor(None, on_thread)
    back = time.perf_counter()
    finish()
    return {
        "queue": marks["thread_start"] - start,
        "work": marks["thread_end"] - marks["thread_start"],
        "back": back - marks["thread_end"],
        "total": time.perf_counter() - start,
    }


async def _run(args: argparse.Namespace, model_path: Path, store: bool) -> None:
    rng = random.Random(1)
    text = TextSource(random.Random(2))
    systems = [text.text(f"System prompt {g} ({text.tag()}). ", args.prompt_tokens)
               for g in range(args.groups)]  # fmt: skip
    scorer = _scorer(model_path, store)
    until = time.monotonic() + args.requests / args.rate + 5
    busy = asyncio.create_task(_busy_loop(args.loop_busy, until)) if args.loop_busy else None
    lags: list[float] = []
    lag = asyncio.create_task(_lag(until, lags))
    results: dict[str, list[float]] = {}
    for i in range(args.requests):
        prompt = rng.choice(systems) + text.text(f"\nQuestion {i}: ", 50)
        body = {"model": "m", "prompt": prompt, "max_tokens": 10}
        request = parse_request(f"r{i}", Api.COMPLETIONS, orjson.dumps(body))
        if store:
            assert scorer._store is not None
            hits = scorer._store.hits
            start = time.perf_counter()
            assert scorer.prepare(request) is None
            took = time.perf_counter() - start
            results.setdefault("hit" if scorer._store.hits > hits else "miss", []).append(took)
        else:
            for name, value in (await _thread_path(scorer, request)).items():
                results.setdefault(name, []).append(value)
        await asyncio.sleep(rng.expovariate(args.rate))
    if busy is not None:
        busy.cancel()
    lag.cancel()
    results["loop lag (a 1 ms sleep's oversleep)"] = lags
    print("with the prefix store (on the loop, never waiting):" if store else
          "without the prefix store (a thread, waited for):")  # fmt: skip
    for name, values in results.items():
        print(_line(name, values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--rate", type=float, default=6.75)
    parser.add_argument("--hogs", type=int, default=0)
    parser.add_argument("--loop-busy", type=float, default=0.0)
    args = parser.parse_args()
    model_path = build_tokenizer(Path(tempfile.mkdtemp()))
    model = load_tokenizer(model_path)
    sample = TextSource(random.Random(3)).text("System prompt 0. ", args.prompt_tokens)
    sample += TextSource(random.Random(4)).text("\nQuestion 0: ", 50)
    alone = []
    for _ in range(20):
        start = time.perf_counter()
        model.encode(sample, special=True)
        alone.append(time.perf_counter() - start)
    print(f"{len(model.encode(sample, True))} tokens; tokenizing alone:",
          _line("encode", alone).strip())  # fmt: skip
    hogs = [multiprocessing.Process(target=_hog, args=(time.time() + 600,), daemon=True)
            for _ in range(args.hogs)]  # fmt: skip
    for hog in hogs:
        hog.start()
    try:
        for store in (False, True):
            asyncio.run(_run(args, model_path, store))
    finally:
        for hog in hogs:
            hog.terminate()
            hog.join()


if __name__ == "__main__":
    main()
