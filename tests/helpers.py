"""Shared test helpers that need no downloads."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from slime.model import CHAT_TEMPLATE, build_char_tokenizer


def make_char_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """The project's character-level tokenizer (ids 0..5 are the special tokens)."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = chat_template
    return tokenizer
