"""The prefix store: a prompt sharing a stored text prefix gets exactly the tokens tokenizing
it whole gives, tokenizing only its tail; past the budget, only leading tokens that are right;
bounded in chunks. The block memo: the hasher's hashes, reusing kept segments, bounded."""

from __future__ import annotations

import random
from array import array
from pathlib import Path

import pytest
from tests.support.kvevents import WORDS, build_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from endpoint_picker.kvevents.blockmemo import BlockMemo
from endpoint_picker.kvevents.index import BlockHasher
from endpoint_picker.kvevents.prefixstore import GUARD, PrefixStore
from endpoint_picker.kvevents.tokens import ModelTokenizer, load_tokenizer

ODD = ["internationalization", "über", "日本語", "x" * 70, "  ", "\n\n", "3.14159", "ab-cd"]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    return load_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


def metaspace_with_eos(byte_level: ModelTokenizer) -> ModelTokenizer:
    """A SentencePiece-like tokenizer (Metaspace, a space prepended to every text) whose
    post-processor adds a BOS first and an EOS last: the cases where tokenizing a tail alone
    differs from tokenizing it in place."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace()
    from tokenizers import trainers

    corpus = [" ".join(random.Random(i).choices(WORDS + ODD, k=40)) for i in range(200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))  # fmt: skip
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return ModelTokenizer(tok, None, "<s>", "</s>", "metaspace")


def text(rng: random.Random, chars: int) -> str:
    out = " ".join(rng.choices(WORDS + ODD, k=chars // 3))
    return out[:chars]


@pytest.mark.parametrize("kind", ["byte-level", "metaspace+eos"])
def test_shared_prefixes_tokenize_exactly_as_whole_prompts(
    byte_level: ModelTokenizer, kind: str
) -> None:
    """Prompts sharing system prompts (cut at every kind of place: inside a word, a number, a
    multibyte character, a run of spaces) get the whole prompt's tokens, and most of them
    come from the store."""
    model = byte_level if kind == "byte-level" else metaspace_with_eos(byte_level)
    rng = random.Random(7)
    store = PrefixStore(chunk_chars=128, max_chunks=10_000)
    systems = [text(rng, rng.randrange(300, 2000)) for _ in range(6)]
    for i in range(120):
        system = rng.choice(systems)
        cut = rng.randrange(len(system) // 2, len(system) + 1)  # a prompt ends mid-anything
        prompt = system[:cut] + text(rng, rng.randrange(0, 200))
        out = store.tokenize(model.encode_tokens, "root", prompt, True, 4096, model.appended)
        whole = model.tokenizer.encode(prompt).ids
        assert out.complete
        assert list(out.ids) == whole, (i, prompt)
    assert store.hits > 80


def test_past_the_budget_only_right_leading_tokens(byte_level: ModelTokenizer) -> None:
    """A prompt whose untokenized part exceeds the budget gets its leading tokens only, each
    one as tokenizing the whole prompt gives it; the second time, the caller is told to store
    it whole; storing it then completes the next."""
    rng = random.Random(3)
    store = PrefixStore(chunk_chars=128, max_chunks=10_000)
    for _ in range(30):
        prompt = text(rng, 3000)
        whole = byte_level.tokenizer.encode(prompt).ids
        out = store.tokenize(byte_level.encode_tokens, "r", prompt, True, 600, byte_level.appended)
        assert not out.complete
        assert not out.store  # seen once
        out = store.tokenize(byte_level.encode_tokens, "r", prompt, True, 600, byte_level.appended)
        assert out.store  # seen twice: worth tokenizing whole
        assert 0 < len(out.ids) < len(whole)
        assert list(out.ids) == whole[: len(out.ids)]
        assert byte_level.encode_tokens(prompt[: 600 - GUARD], True)[0].ends[-1] <= 600
        store.add(store.keys("r", prompt), byte_level.encode_tokens(prompt, True)[0])
        again = prompt[:2900] + " the lazy dog"
        out = store.tokenize(byte_level.encode_tokens, "r", again, True, 600, byte_level.appended)
        assert out.complete
        assert list(out.ids) == byte_level.tokenizer.encode(again).ids


def test_the_store_is_bounded_and_keyed_by_root(byte_level: ModelTokenizer) -> None:
    """At most max_chunks chunks, least recently used out first; another root (another
    tokenizer, or special tokens on/off) never finds this one's chunks."""
    store = PrefixStore(chunk_chars=128, max_chunks=20)
    rng = random.Random(5)
    prompts = [text(rng, 128 * 15) for _ in range(3)]
    for prompt in prompts:
        store.tokenize(byte_level.encode_tokens, "a", prompt, True, 10_000, byte_level.appended)
        assert len(store) <= 20
    assert len(store.lookup("a", prompts[-1])[1]) == 15
    assert not store.lookup("a", prompts[0])[1]  # evicted
    assert not store.lookup("b", prompts[-1])[1]


def test_chunks_shorter_than_the_margins_are_refused() -> None:
    """A chunk must be longer than the re-tokenized margins, or nothing could splice."""
    with pytest.raises(ValueError, match="chunk_chars"):
        PrefixStore(chunk_chars=64)


def test_load_tokenizer_reads_the_same_file_for_both_paths(tmp_path: Path) -> None:
    """encode_tokens gives the ids encode gives, with offsets that never go back."""
    model = load_tokenizer(build_tokenizer(tmp_path))
    prompt = "the quick über 日本語 fox " * 20
    tokens, appended = model.encode_tokens(prompt, True)
    assert list(tokens.ids) + list(appended) == list(model.encode(prompt, True))
    assert list(tokens.ends) == sorted(tokens.ends)


def test_the_block_memo_hashes_as_the_hasher_does() -> None:
    """Segments kept from an earlier prompt give the same block hashes as hashing the whole
    prompt; the memo is bounded."""
    hasher = BlockHasher(4)
    memo = BlockMemo(hasher, max_segments=5)
    rng = random.Random(9)
    shared = [rng.randrange(1000) for _ in range(300)]
    for n in range(20):
        tokens = array("I", shared + [rng.randrange(1000) for _ in range(rng.randrange(0, 90))])
        root = hasher.root(None if n % 3 else "lora")
        limit = rng.choice([1000, 50, 3])
        assert memo.chain(root, tokens, limit) == hasher.chain(root, tokens, max_blocks=limit)
        assert len(memo) <= 5


def test_the_doorkeeper_is_bounded(byte_level: ModelTokenizer) -> None:
    """A client sending only distinct prompts (each seen once, never stored) cannot grow the
    doorkeeper's record of prompts seen past max_chunks; the oldest is forgotten first."""
    store = PrefixStore(chunk_chars=128, max_chunks=16)
    rng = random.Random(9)
    prompts = [text(rng, 3000) for _ in range(200)]
    for prompt in prompts:
        store.tokenize(byte_level.encode_tokens, "r", prompt, True, 600, byte_level.appended)
    assert len(store._seen) <= 16
    again = store.tokenize(
        byte_level.encode_tokens, "r", prompts[0], True, 600, byte_level.appended
    )
    assert not again.store  # forgotten: seen "once" again
