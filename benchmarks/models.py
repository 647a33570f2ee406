"""Models the benchmarks build from transformers configs (random init) beside the project's default
tiny MoE: issue 21's Qwen2-MoE and a dense Llama, both sized for the char tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.families import tiny_model

SHAPES: dict[str, dict[str, int]] = {
    # 8 experts plus a shared expert, 2.2M parameters with the char tokenizer (issue 21's model)
    "qwen2_moe": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
    },
    # dense, 3.2M parameters with the char tokenizer
    "llama": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}


def build(name: str, vocab_size: int, **overrides: Any) -> torch.nn.Module:
    return tiny_model(name, vocab_size=vocab_size, **{**SHAPES[name], **overrides})


def build_warmstarted(name: str, path: Path, warmstart_overrides: list[str] | None = None) -> Path:
    """`name` from SHAPES with the char tokenizer, warm-started like the project's default model
    (its `model.warmstart` config, with `warmstart_overrides` applied), saved under `path`."""
    from slime.config import load_config
    from slime.model import build_char_tokenizer, warmstart

    tokenizer = build_char_tokenizer()
    model = build(
        name,
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    warmstart(model, tokenizer, load_config(None, list(warmstart_overrides or [])).model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
