"""One tokenizer for the fleet and the EPP: a small byte-level BPE over the bench's prompt
vocabulary, trained in-process (no model hub, no network) into the run's folder.

``epp bench run --tokenizer build`` writes ``tokenizer.json`` (and a ``tokenizer_config.json``
whose ``chat_template`` renders chat messages exactly as the simulator's Llama-3-style template,
``endpoint_picker_sim.tokenizer.render_chat``) and gives the file to ``epp sim --tokenizer``; the
EPP reads the same file, so both sides tokenize every prompt to the same ids.

Byte-level, so any text (digits, hex tags, punctuation) tokenizes losslessly and two different
prompts never share ids by an unknown-token accident. The corpus is the prompt words
(``prompts._VOCAB``), the simulator's reply words and the workloads' heads, so common words are
single tokens, as with a real model's vocabulary. Training is deterministic for a given corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from endpoint_picker.bench.prompts import _VOCAB
from endpoint_picker_sim.tokenizer import generate_text

# The simulator's chat template (render_chat) as a Hugging Face chat template.
SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
VOCAB_SIZE = 2048
_HEADS = ("System prompt", "Question", "Tenant", "request", "Document", "session")


def _corpus() -> list[str]:
    words = [*_VOCAB, *generate_text(0, 64).split(), *_HEADS]
    lines = [" ".join(words[i:] + words[:i]) for i in range(0, len(words), 7)]
    lines += [" ".join(f"{h} {n} ({n:08x}):" for n in range(k, 4096, 97)) for k, h in
              enumerate(_HEADS)]  # fmt: skip
    return lines


def build_tokenizer(folder: Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``; return the first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(s, special=True) for s in SPECIAL],
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    config = {
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[3],
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
