"""The learner's model FLOPs (slime/learner/flops.py): 6 x active parameters x tokens, and the
GPU's peak by its name."""

from __future__ import annotations

import pytest
import torch
import transformers

from slime.learner import flops


def test_an_moe_counts_top_k_of_its_experts_and_neither_the_embedding_nor_the_head() -> None:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    attention = 32 * 32 + 16 * 32 + 16 * 32 + 32 * 32 + 8 + 8  # q, k, v, o, q/k norms
    experts = 8 * (32 * 2 * 16 + 16 * 32)  # gate_up and down of all 8
    per_layer = attention + experts * 2 // 8 + 8 * 32 + 2 * 32  # 2 of 8 experts, the router, two norms
    assert flops.active_parameters(model) == 2 * per_layer + 32  # + the final norm
    assert flops.training_flops(1000, tokens=50, passes=2) == 6 * 1000 * 50 * 2


def test_a_dense_model_counts_every_parameter_but_the_embedding_and_the_head() -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert flops.active_parameters(model) == total - 2 * 100 * 16


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H200", 989.4),
        ("NVIDIA GH200 480GB", 989.4),
        ("NVIDIA H20", 148.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce RTX 4090", None),  # not listed: TFLOPS only, no MFU
    ],
)
def test_the_peak_is_found_by_the_gpus_name(monkeypatch: pytest.MonkeyPatch, name: str, peak: float | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert flops.peak_tflops("cuda:0") == peak


def test_a_cpu_has_no_peak() -> None:
    assert flops.peak_tflops("cpu") is None
