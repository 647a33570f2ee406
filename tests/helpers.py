"""Shared test fixtures that need no downloads: a character-level tokenizer built in code."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_char_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus the special tokens above (ids 0..5)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(string.printable))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()  # join characters back without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tokenizer.chat_template = chat_template
    return tokenizer
