"""Tiny random-init models of the decoder families people post-train, built from their
transformers configs: what the engine's fast-path tests and `benchmarks/model_zoo.py` run on.

Each family keeps what makes it itself at a tiny size: experts and shared experts, MLA attention
(DeepSeek-V2/V3), grouped routing (GLM-4.5, DeepSeek), sliding-window layers, attention sinks
(gpt-oss), logit soft-capping (Gemma 2), q/k norms (Qwen3, Gemma 3).
"""

from __future__ import annotations

from typing import Any

import torch

_MOE = {"num_experts_per_tok": 2}
_SLIDING_PAIR = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
# Routed experts with a shared one, the first layer dense, grouped routing (DeepSeek, GLM-4.5).
_ROUTED = {
    **_MOE,
    "n_routed_experts": 4,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}
_MLA = {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}

# model_type -> what differs from the shared tiny shape (MoE families first, then dense ones).
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {**_MOE, "num_experts": 4, "moe_intermediate_size": 32},
    "qwen2_moe": {**_MOE, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
    "mixtral": {**_MOE, "num_local_experts": 4},
    "olmoe": {**_MOE, "num_experts": 4},
    "deepseek_v2": {**_ROUTED, **_MLA, "q_lora_rank": None},
    "deepseek_v3": {**_ROUTED, **_MLA, "q_lora_rank": 24},
    "glm4_moe": {**_ROUTED, "head_dim": 16},
    "gpt_oss": {**_MOE, **_SLIDING_PAIR, "num_local_experts": 4, "head_dim": 16},
    "llama": {},
    "mistral": {"sliding_window": 8},
    "qwen2": {},
    "qwen3": {},
    "gemma2": {**_SLIDING_PAIR, "head_dim": 16},
    "gemma3_text": {**_SLIDING_PAIR, "head_dim": 16},
    "phi3": {},
}

TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_config(family: str, vocab_size: int = 97, **overrides: Any):
    """The transformers config of a tiny ``family`` model (``overrides`` win)."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    settings = {**TINY_SHAPE, "vocab_size": vocab_size, **FAMILIES[family], **overrides}
    if "layer_types" in settings and "layer_types" not in overrides:  # the family's pattern, repeated
        pattern = settings["layer_types"]
        settings["layer_types"] = [pattern[i % len(pattern)] for i in range(settings["num_hidden_layers"])]
    return AutoConfig.for_model(family, **settings)


def tiny_model(family: str, vocab_size: int = 97, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random-init tiny ``family`` causal LM in eval mode. Attention sinks start at zero in
    transformers; they get random values here, so that a path ignoring them would show."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab_size, **overrides)).eval()
    with torch.no_grad():
        for module in model.modules():
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.nn.Parameter):
                sinks.normal_(0.0, 1.0)
    return model
