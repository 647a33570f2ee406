"""Tiny random-init models of the decoder families people post-train, built from their
transformers configs: what the engine's fast-path tests and `benchmarks/model_zoo.py` run on.

Each family keeps what makes it itself at a tiny size: experts and shared experts, MLA attention
(DeepSeek-V2/V3), grouped routing (GLM-4.5, DeepSeek), sliding-window layers, attention sinks
(gpt-oss), logit soft-capping (Gemma 2), q/k norms (Qwen3, Gemma 3).
"""

from __future__ import annotations

import functools
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
    """The transformers config of a tiny ``family`` model (``overrides`` win): a curated family of
    `FAMILIES`, or any model type transformers knows, shrunk by `tiny_settings`."""
    from transformers import AutoConfig

    base = FAMILIES[family] if family in FAMILIES else tiny_settings(family)
    settings = {**TINY_SHAPE, "vocab_size": vocab_size, **base, **overrides}
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


# Config fields that size a model beyond TINY_SHAPE, and their tiny values.
_TINY_FIELDS = {
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k"), 2),
    **dict.fromkeys(("n_group", "topk_group", "n_shared_experts", "first_k_dense_replace"), 1),
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "head_dim": 16,
    "rotary_dim": 8,
    **_MLA,
    **dict.fromkeys(("index_n_heads", "index_head_dim"), 16),  # sparse attention's indexer (DeepSeek-V3.2)
}

# Scales that are 1 in the default configs: set otherwise, so that a path ignoring them would show.
_SCALES = {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 2.0, "attention_multiplier": 0.2}


def tiny_settings(model_type: str) -> dict[str, Any]:
    """The fields of ``model_type``'s default config to shrink (TINY_SHAPE's and `_TINY_FIELDS`')
    or to set off 1 (`_SCALES`), read from its field names; a layer-type pattern becomes one layer of each type."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    fields = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    settings = {k: v for k, v in {**TINY_SHAPE, **_TINY_FIELDS, **_SCALES}.items() if k in fields}
    if "q_lora_rank" in fields:  # queries through a low-rank pair, if the family has one by default
        settings["q_lora_rank"] = None if config.to_dict()["q_lora_rank"] is None else 24
    if "kv_lora_rank" in fields:  # latent attention expands keys and values to every query head
        settings["num_key_value_heads"] = TINY_SHAPE["num_attention_heads"]
    types = config.to_dict().get("layer_types")
    if isinstance(types, list) and types:
        kinds = list(dict.fromkeys(types))
        settings["layer_types"] = kinds
        settings["num_hidden_layers"] = max(len(kinds), TINY_SHAPE["num_hidden_layers"])
    return settings


# Sub-configs that make a model type a composite of a text decoder and other modalities.
_COMPOSITE = ("text_config", "vision_config", "audio_config", "audio_encoder_config", "vq_config")
MAX_TINY_PARAMS = 30_000_000


def _refusal_before_building(model_type: str) -> str | None:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    config = AutoConfig.for_model(model_type)
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "an encoder family (masked-LM head) with a causal head"
    composite = [name for name in getattr(config, "sub_configs", None) or {} if name in _COMPOSITE]
    if composite:
        return f"multimodal: a composite of {', '.join(composite)} (its text decoder is its own model type)"
    return None


@torch.inference_mode()
def _build_refusal(model_type: str, overrides: dict[str, Any]) -> str | None:
    """Why a tiny ``model_type`` with ``overrides`` does not build and run a forward, or None."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    with torch.device("meta"):  # counted before any memory is spent on it
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if params > MAX_TINY_PARAMS:
        return f"not tiny at the tiny shape: {params / 1e6:.0f}M parameters (other size fields)"
    model = tiny_model(model_type, **overrides)
    model(input_ids=torch.tensor([[3, 4, 5]]))
    return None


@functools.cache
def discover_families() -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every causal-LM model type of the installed transformers: ({model type: the overrides that
    build a tiny decoder-only model of it}, {refused model type: why}). Encoder-decoders, encoders
    with a causal head and multimodal composites are refused unbuilt; the rest are built tiny
    (`tiny_settings`, or with as many key-value heads as query heads where only that builds)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    built: dict[str, dict[str, Any]] = {}
    refused: dict[str, str] = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type in FAMILIES:
            built[model_type] = dict(FAMILIES[model_type])
            continue
        try:
            reason = _refusal_before_building(model_type)
        except Exception as exc:
            reason = f"config: {type(exc).__name__}: {_short(exc)}"
        if reason is None:
            for overrides in ({}, {"num_key_value_heads": TINY_SHAPE["num_attention_heads"]}):
                try:
                    reason = _build_refusal(model_type, overrides)
                except Exception as exc:
                    reason = reason or f"{type(exc).__name__}: {_short(exc)}"
                    continue
                if reason is None:
                    built[model_type] = overrides
                break
        if reason is not None:
            refused[model_type] = reason
    return built, refused


def buildable_families() -> dict[str, dict[str, Any]]:
    """Model type -> the `tiny_model` overrides that build it, for every buildable decoder-only family."""
    return discover_families()[0]


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160]
