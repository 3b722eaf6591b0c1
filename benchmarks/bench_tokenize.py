"""Benchmark: what precise-prefix-cache-scorer's tokenizing costs, by prompt size.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/bench_tokenize.py [--tokenizer PATH]``
(a benchmark, not a test). Prompts are the bench's filler text (about 4 characters a token);
without ``--tokenizer`` it trains the bench's byte-level BPE (``epp bench --tokenizer build``);
give a real model's ``tokenizer.json`` for real figures. For each prompt size it prints the
median milliseconds of: tokenizing (``PromptTokenizer.tokens``, completions), hashing the
blocks (16 tokens each), the cache key, and how much of the event loop a thread tokenizing
it leaves (a loop's spin rate during ten tokenizings on a thread against alone: 100% is
untouched), with ``encode`` (holds the GIL) and ``encode_batch`` (lets go of it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import orjson

from endpoint_picker.bench.prompts import TextSource
from endpoint_picker.bench.tokenizer import build_tokenizer
from endpoint_picker.kvevents.index import BlockHasher
from endpoint_picker.kvevents.tokens import PromptTokenizer, load_tokenizer
from endpoint_picker.requests import Api, parse_request


def median_ms(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _spin_rate(seconds: float) -> float:
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        n += 1
    return n / seconds


def loop_share(fn) -> float:  # type: ignore[no-untyped-def]
    """This thread's spin rate while ``fn`` runs ten times on another, over its rate alone
    (the median of three alone before and after: the machine is shared)."""
    rates = []
    for _ in range(3):
        alone = statistics.median(_spin_rate(0.05) for _ in range(3))
        done = threading.Event()
        thread = threading.Thread(target=lambda d=done: ([fn() for _ in range(10)], d.set()))
        start, n = time.perf_counter(), 0
        thread.start()
        while not done.is_set():
            n += 1
        thread.join()
        after = statistics.median(_spin_rate(0.05) for _ in range(3))
        rates.append((n / (time.perf_counter() - start)) / ((alone + after) / 2))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--tokens", default="1000,8000,32000")
    args = parser.parse_args()
    path = args.tokenizer
    if path is None:  # the bench's own BPE (what `epp bench --tokenizer build` trains)
        path = build_tokenizer(Path(tempfile.mkdtemp()))
    model = load_tokenizer(path)
    prompts = PromptTokenizer({"": model})
    hasher = BlockHasher(16)
    for target in (int(t) for t in args.tokens.split(",")):
        prompt = TextSource(random.Random(target)).text("System prompt: ", target)
        request = parse_request(
            "r", Api.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prompt})
        )
        tokens = prompts.tokens(request)
        assert tokens is not None
        tokenize = median_ms(lambda r=request: prompts.tokens(r), 9)
        hashing = median_ms(lambda t=tokens: hasher.chain(0, t), 9)
        key = median_ms(lambda r=request: prompts.key(r), 9)
        held = loop_share(lambda r=request: prompts.tokens(r))
        released = loop_share(lambda r=request: prompts.tokens(r, off_loop=True))
        print(
            f"{len(tokens):>6} tokens ({len(prompt) // 1024} KB): tokenize {tokenize:.2f} ms, "
            f"hash {hashing:.2f} ms, cache key {key:.3f} ms; a loop beside a thread tokenizing "
            f"runs at {held:.0%} of its speed alone with encode, {released:.0%} with "
            "encode_batch (the GIL let go)"
        )


if __name__ == "__main__":
    main()
