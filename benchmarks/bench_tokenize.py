"""Benchmark: what precise-prefix-cache-scorer's tokenizing costs, by prompt size.

Run: ``PYTHONPATH=src:. .venv/bin/python benchmarks/bench_tokenize.py [--tokenizer PATH]``
(a benchmark, not a test). Without ``--tokenizer`` it trains the tests' small byte-level BPE;
give a real model's ``tokenizer.json`` for real figures. For each prompt size it prints the
median milliseconds of: tokenizing (``PromptTokenizer.tokens``, completions), hashing the
blocks (16 tokens each), the whole ``prepare`` on a cache miss and on a hit, and how much of
the event loop a thread tokenizing it leaves (a loop's spin count during the thread's work
against alone: 1.0 is untouched).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import orjson

from endpoint_picker.kvevents.index import BlockHasher
from endpoint_picker.kvevents.tokens import PromptTokenizer, load_tokenizer
from endpoint_picker.requests import Api, parse_request

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "a",
    "model",
    "server",
    "caches",
    "blocks",
    "of",
    "tokens",
    "for",
    "every",
    "prompt",
    "it",
    "serves",
    "and",
    "the",
    "gateway",
    "routes",
    "by",
    "prefix",
]


def median_ms(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def loop_share(fn) -> float:  # type: ignore[no-untyped-def]
    """Spins per second of this thread while ``fn`` runs on another, over spins alone."""
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        n += 1
    alone = n / 0.2
    done = threading.Event()
    thread = threading.Thread(target=lambda: (fn(), fn(), fn(), done.set()))
    start, n = time.perf_counter(), 0
    thread.start()
    while not done.is_set():
        n += 1
    thread.join()
    return (n / (time.perf_counter() - start)) / alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--tokens", default="1000,8000,32000")
    args = parser.parse_args()
    path = args.tokenizer
    if path is None:
        from tests.support.kvevents import build_tokenizer

        path = build_tokenizer(Path(tempfile.mkdtemp()))
    model = load_tokenizer(path)
    prompts = PromptTokenizer({"": model})
    hasher = BlockHasher(16)
    for target in (int(t) for t in args.tokens.split(",")):
        text, i = [], 0
        while len(model.encode(" ".join(text), special=False)) < target:
            text.extend(WORDS[(i * 7 + j) % len(WORDS)] for j in range(200))
            i += 1
        prompt = " ".join(text)
        request = parse_request(
            "r", Api.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prompt})
        )
        tokens = prompts.tokens(request)
        assert tokens is not None
        tokenize = median_ms(lambda r=request: prompts.tokens(r), 9)
        hashing = median_ms(lambda t=tokens: hasher.chain(0, t), 9)
        key = median_ms(lambda r=request: prompts.key(r), 9)
        share = loop_share(lambda r=request: prompts.tokens(r))
        print(
            f"{len(tokens):>6} tokens ({len(prompt) // 1024} KB): tokenize {tokenize:.2f} ms, "
            f"hash {hashing:.2f} ms, cache key {key:.3f} ms; a loop beside a tokenizing "
            f"thread runs at {share:.0%} of its speed alone"
        )


if __name__ == "__main__":
    main()
