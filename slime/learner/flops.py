"""The learner's model FLOPs and its share of the GPU's peak (MFU), as `learner_model_tflops` and
`learner_mfu` each step (docs/metrics.md).

A token costs 6 x N FLOPs in a forward and backward pass, N the parameters a token goes through
without the input embedding and the output head: in an MoE layer, top_k of its n experts
(PaLM's 6N; attention's own matmuls and the head are not counted, so the figure is a floor). The
peak is the GPU's bf16 dense peak, known by a substring of its name; on a CPU or a GPU not listed,
MFU is not reported and the TFLOPS figure stands alone.
"""

from __future__ import annotations

import torch

PEAK_TFLOPS = [  # bf16 dense, by a substring of torch.cuda.get_device_name(); first match wins
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM ("H100 80GB HBM3")
    ("H200", 989.4),
    ("GH200", 989.4),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
]

# Config names of an MoE's routed experts per token and in all, across the families transformers ships.
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")
_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def peak_tflops(device: str | torch.device) -> float | None:
    """The bf16 dense peak of a CUDA device in TFLOPS, or None (CPU, or a GPU not listed)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    # "GH200" contains "H200" and "H20": the longer names are listed first where it matters.
    return next((tflops for key, tflops in sorted(PEAK_TFLOPS, key=lambda kv: -len(kv[0])) if key in name), None)


def _routed_share(config: object) -> float:
    """top_k / n of an MoE config (1.0 for a dense one)."""
    top_k = next((getattr(config, k) for k in _TOP_K_KEYS if isinstance(getattr(config, k, None), int)), None)
    experts = next((getattr(config, k) for k in _EXPERTS_KEYS if isinstance(getattr(config, k, None), int)), None)
    if not top_k or not experts or top_k >= experts:
        return 1.0
    return top_k / experts


def active_parameters(model: torch.nn.Module) -> int:
    """N of 6 x N x tokens: the parameters one token goes through, without the input embedding and the
    output head; routed experts (parameters under a module named ``experts``) count top_k / n. A
    sharded parameter counts its whole size (a DTensor's numel is the global one)."""
    config = getattr(model, "config", None)
    share = _routed_share(config) if config is not None else 1.0
    skip = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get, lambda: None)()
        if module is not None and getattr(module, "weight", None) is not None:
            skip.add(id(module.weight))
    total = 0.0
    for name, p in model.named_parameters():
        if id(p) in skip:
            continue
        routed = ".experts." in f".{name}" and ".shared_expert" not in name
        total += p.numel() * (share if routed else 1.0)
    return int(total)


def training_flops(active_params: int, tokens: int, passes: int = 1) -> float:
    """The FLOPs of `passes` forward-and-backward passes over `tokens` tokens (6 x N per token)."""
    return 6.0 * active_params * tokens * passes
