"""precise-prefix-cache-scorer: its config (the reference's parameter names, exact error paths),
its scores from the index, and the off-loop tokenizing of long prompts."""

from __future__ import annotations

import asyncio
import random
from array import array
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
from tests.support.kvevents import build_tokenizer
from tests.unit.scheduling.builders import HEADER, clock, endpoint
from tokenizers import Tokenizer

from endpoint_picker.errors import ConfigError
from endpoint_picker.kvevents.wire import BlockStored
from endpoint_picker.requests import Api, parse_request
from endpoint_picker.scheduling import build_scheduling, load_config
from endpoint_picker.scheduling.plugins.precise import PrecisePrefixCacheScorer
from endpoint_picker.settings import SchedulingSettings

EXAMPLE = Path(__file__).parents[3] / "deploy" / "examples" / "scheduler-config-precise-prefix.yaml"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def scorer_of(yaml_text: str, tokenizer: Path | None) -> PrecisePrefixCacheScorer:
    settings = SchedulingSettings(tokenizers=(("", tokenizer),) if tokenizer else ())
    parts = build_scheduling(
        load_config(yaml_text), settings=settings, staleness_threshold=2.0, clock=clock,
        rng=random.Random(0),
    )  # fmt: skip
    (profile,) = parts.scheduler.profiles.values()
    scorer = next(
        s.scorer for s in profile._scorers if isinstance(s.scorer, PrecisePrefixCacheScorer)
    )
    assert parts.kv_events is scorer.hub
    assert parts.preparers == (scorer,)
    return scorer


CONFIG = (
    HEADER
    + """\
plugins:
- type: precise-prefix-cache-scorer
  parameters:
    tokenProcessorConfig: {blockSize: 4}
    inlineBytes: 300
"""
)


def completion(prompt: str):  # type: ignore[no-untyped-def]
    return parse_request("r", Api.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prompt}))


def test_the_example_config_validates_and_builds() -> None:
    """deploy/examples/scheduler-config-precise-prefix.yaml is accepted by the loader."""
    config = load_config(EXAMPLE.read_text(), str(EXAMPLE))
    assert [p.type for p in config.plugins][1] == "precise-prefix-cache-scorer"


@pytest.mark.parametrize(
    ("parameters", "path"),
    [
        ("tokenProcessorConfig: {blockSize: 0}", "parameters.tokenProcessorConfig.blockSize"),
        ("tokenProcessorConfig: {hashseed: x}", "parameters.tokenProcessorConfig.hashseed"),
        ("kvEventsConfig: {socketPort: -1}", "parameters.kvEventsConfig.socketPort"),
        ("kvEventsConfig: {podDiscoveryConfig: {socketPort: x}}",
         "parameters.kvEventsConfig.podDiscoveryConfig.socketPort"),
        ("kvEventsConfig: {discoverPods: false}", "parameters.kvEventsConfig.discoverPods"),
        ("kvEventsConfig: {deadAfter: soon}", "parameters.kvEventsConfig.deadAfter"),
        ("kvEventsConfig: []", "parameters.kvEventsConfig"),
        ("indexerConfig: {kvBlockIndexConfig: {inMemoryConfig: {size: 0}}}",
         "parameters.indexerConfig.kvBlockIndexConfig.inMemoryConfig.size"),
        ("indexerConfig: {tokenizersPoolConfig: {}}",
         "parameters.indexerConfig.tokenizersPoolConfig"),
    ],
)  # fmt: skip
def test_bad_parameters_name_their_path(parameters: str, path: str) -> None:
    """Every parameter, nested ones too, is checked and reported with its exact path."""
    text = (
        HEADER + f"plugins:\n- type: precise-prefix-cache-scorer\n  parameters: {{{parameters}}}\n"
    )
    with pytest.raises(ConfigError, match=f"plugins\\[0\\].{path}"):
        load_config(text)


def test_llm_d_parameter_names_are_read() -> None:
    """blockSizeTokens over blockSize, podDiscoveryConfig.socketPort, zmqEndpoint binds."""
    text = (
        HEADER
        + """\
plugins:
- type: precise-prefix-cache-scorer
  parameters:
    tokenProcessorConfig: {blockSize: 64, blockSizeTokens: 32, hashSeed: "42"}
    kvEventsConfig: {zmqEndpoint: "tcp://*:5557", topicFilter: "kv@", discoverPods: false,
                     podDiscoveryConfig: {socketPort: 6000}}
"""
    )
    scorer = scorer_of(text, None)
    assert scorer.index.hasher.block_size == 32
    config = scorer.hub.config
    assert (config.bind_endpoint, config.topic_filter, config.port) == ("tcp://*:5557", "kv@", 6000)


def stored_prompt(scorer: PrecisePrefixCacheScorer, tok: Tokenizer, prompt: str, blocks: int,
                  address: str) -> None:  # fmt: skip
    """Index ``blocks`` leading blocks of ``prompt`` as held by ``address``."""
    ids = tok.encode(prompt).ids[: blocks * 4]
    hashes = tuple(range(1, blocks + 1))
    event = BlockStored(hashes, None, array("I", ids), 4, None, None, None, None)
    scorer.index.apply(address, [event])


def test_endpoints_score_the_fraction_of_the_prompt_they_hold(tokenizer_path: Path) -> None:
    """Scores are leading blocks held / the prompt's blocks, per the events."""
    scorer = scorer_of(CONFIG, tokenizer_path)
    tok = Tokenizer.from_file(str(tokenizer_path))
    prompt = " ".join(WORDS * 4)
    total = len(tok.encode(prompt).ids) // 4
    a, b, c = endpoint(), endpoint(), endpoint()
    stored_prompt(scorer, tok, prompt, total, b.endpoint.address)
    stored_prompt(scorer, tok, prompt, 2, c.endpoint.address)
    request = completion(prompt)
    assert scorer.prepare(request) is None  # short: tokenized inline
    assert scorer.score(request, [a, b, c]) == [0.0, 1.0, 2 / total]


def test_no_tokenizer_scores_zero(tokenizer_path: Path) -> None:
    """A model without a tokenizer gets 0 everywhere: the other scorers decide."""
    scorer = scorer_of(CONFIG, None)
    request = completion("the quick brown fox jumps")
    assert scorer.prepare(request) is None
    assert scorer.score(request, [endpoint(), endpoint()]) == [0.0, 0.0]


NO_STORE = CONFIG + "    prefixStoreConfig: {cacheSize: 0}\n"
STORE = CONFIG.replace("inlineBytes: 300", "inlineBytes: 400") + (
    "    prefixStoreConfig: {blockSize: 128}\n"
)


def test_a_long_prompt_is_prepared_off_the_loop_and_bounded(tokenizer_path: Path) -> None:
    """Without the prefix store, past inlineBytes the tokenizing is handed back as thread work
    (at most maxPendingTokenize at a time; past it: scored 0); its result is kept."""
    scorer = scorer_of(NO_STORE, tokenizer_path)
    tok = Tokenizer.from_file(str(tokenizer_path))
    long = [" ".join(WORDS * 10) + f" {i}" for i in range(3)]
    target = endpoint()
    stored_prompt(scorer, tok, long[0], 8, target.endpoint.address)
    works = [scorer.prepare(completion(p)) for p in long]
    assert works[0] is not None
    assert works[1] is not None
    assert works[2] is None  # two pending already
    request = completion(long[0])
    assert scorer.score(request, [target]) == [0.0]  # not tokenized yet
    finish = works[0]()  # what the thread does
    finish()  # back on the loop
    total = len(tok.encode(long[0]).ids) // 4
    assert scorer.score(request, [target]) == [8 / total]
    assert scorer.prepare(request) is None  # cached now
    works[1]()()
    assert scorer.prepare(completion(long[2])) is not None  # room again


def test_a_stored_prefix_is_scored_at_once_and_exactly(tokenizer_path: Path) -> None:
    """With the prefix store, a long prompt whose system prompt was seen is scored without
    waiting for a thread, from exactly the tokens the whole prompt has."""
    scorer = scorer_of(STORE, tokenizer_path)
    tok = Tokenizer.from_file(str(tokenizer_path))
    system = " ".join(WORDS * 60)
    holder, other = endpoint(), endpoint()
    prompts = [system + f" question {i} the lazy dog" for i in range(3)]
    total = len(tok.encode(prompts[1]).ids) // 4
    stored_prompt(scorer, tok, prompts[1], total, holder.endpoint.address)
    for prompt in prompts:
        assert scorer.prepare(completion(prompt)) is None  # never thread work
    request = completion(prompts[1])
    assert scorer.score(request, [holder, other]) == [1.0, 0.0]


async def test_a_miss_scores_its_leading_blocks_and_is_stored_off_the_loop(
    tokenizer_path: Path,
) -> None:
    """A long prompt not stored is scored at once on its leading blocks (those that
    tokenizing it whole gives); the second time its prefix comes, a thread stores it whole,
    and the third is scored on all its blocks."""
    scorer = scorer_of(STORE, tokenizer_path)
    tok = Tokenizer.from_file(str(tokenizer_path))
    system = " ".join(WORDS * 60)
    first, again, second = (completion(system + f" question {i}") for i in range(3))
    holder = endpoint()
    held = len(tok.encode(system).ids) // 4 - 2
    stored_prompt(scorer, tok, system, held, holder.endpoint.address)
    assert scorer.prepare(first) is None
    (score,) = scorer.score(first, [holder])
    assert score == 1.0  # the leading blocks it knows: all held
    assert scorer._pending == 0  # seen once: not worth tokenizing whole yet
    assert scorer.prepare(again) is None
    assert scorer.score(again, [holder]) == [1.0]
    assert scorer._pending == 1
    for _ in range(200):
        await asyncio.sleep(0.005)
        if not scorer._pending:
            break
    assert scorer._pending == 0
    assert scorer._store is not None
    assert len(scorer._store) > 0
    assert scorer.prepare(second) is None
    total = len(tok.encode(second.body["prompt"]).ids) // 4
    assert scorer.score(second, [holder]) == [held / total]


def test_one_precise_scorer_per_config() -> None:
    """Two would subscribe twice to every pod: refused, naming the second."""
    text = (
        HEADER
        + """\
plugins:
- type: precise-prefix-cache-scorer
- name: again
  type: precise-prefix-cache-scorer
"""
    )
    with pytest.raises(ConfigError, match=r"plugins\[1\].parameters.kvEventsConfig"):
        load_config(text)


def test_an_adapter_seen_in_events_roots_its_requests(tokenizer_path: Path) -> None:
    """A request for a LoRA adapter some server stored blocks for matches those blocks."""
    scorer = scorer_of(CONFIG, tokenizer_path)
    tok = Tokenizer.from_file(str(tokenizer_path))
    prompt = " ".join(WORDS * 2)
    ids = tok.encode(prompt).ids[:8]
    holder = endpoint()
    scorer.index.apply(holder.endpoint.address, [BlockStored((1, 2), None, array("I", ids), 4,
                                                             "sql", None, None, None)])  # fmt: skip
    base = completion(prompt)
    adapter = replace(base, target_model="sql")
    scorer.prepare(base)
    scorer.prepare(adapter)
    assert scorer.score(base, [holder]) == [0.0]
    assert scorer.score(adapter, [holder])[0] > 0


def test_distinct_short_prompts_cannot_grow_the_prompt_cache(tokenizer_path: Path) -> None:
    """A prompt shorter than one block hashes to no block; each cached prompt still counts at
    least one against maxCachedBlocks, so a client sending many distinct short prompts cannot
    grow the cache past it."""
    capped = CONFIG.replace("inlineBytes: 300", "inlineBytes: 300\n    maxCachedBlocks: 50")
    scorer = scorer_of(capped, tokenizer_path)
    for i in range(500):
        assert scorer.prepare(completion(f"{i}")) is None
    assert len(scorer._cache) <= 50
