"""A small byte-level BPE tokenizer, trained offline on built-in text, for tiny test models."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

_CORPUS = """
The quick brown fox jumps over the lazy dog. A trellis code maps a stream of bits to values.
SGLang serves language models with a radix cache, CUDA graphs and speculative decoding.
EXL3 stores each weight matrix as 16x16 tiles; every tile is a tail-biting ring of bits.
Hadamard rotations spread outliers so that a small codebook covers the weights well.
def forward(self, x):\n    return self.down(self.act(self.gate(x)) * self.up(x))\n
Once upon a time there was a small model that answered questions about numbers: 1 2 3 4 5 6 7 8 9 10.
User: What is the capital of France? Assistant: The capital of France is Paris.
"""

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(directory: str | Path, vocab_size: int, corpus: Iterable[str] | None = None) -> dict[str, int]:
    """Train a byte-level BPE of exactly `vocab_size` entries on `corpus` (default: a few built-in lines); write
    tokenizer.json and tokenizer_config.json. Returns the special token ids (bos, eos, pad, user, assistant)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4 if corpus is None else corpus, trainer=trainer)
    # Pad the vocabulary to exactly vocab_size so that embedding rows and ids agree. The padding goes
    # into the BPE vocabulary itself (never produced by encoding), not into added tokens, which
    # transformers loads one by one (12 s for a 128k vocabulary).
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for i in range(vocab_size - tok.get_vocab_size()):
        vocab[f"<|extra_{i}|>"] = len(vocab)
    (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    ids = {name: tok.token_to_id(t) for name, t in zip(("bos", "eos", "pad", "user", "assistant"), SPECIAL_TOKENS,
                                                       strict=True)}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "model_max_length": 4096,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids
