"""What the hand-written layers (`slime.engines.fast_decoder`) read from a model: which decoders fit,
by their modules rather than their model type (:func:`hand_written_misfit`), and each layer's
tensors (:class:`LayerTensors`: views of the model's own parameters, so an in-place weight update
is seen at once), with the small maths the layers share (RMSNorm, RoPE, gated MLPs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# What a decoder layer may hold for the hand-written layers (dropouts are identity in eval).
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
# Norms around the MLP too (Gemma 2/3): attention and MLP outputs are normed before the residual.
_SANDWICH_PARTS = _LAYER_PARTS | {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_norm", "k_norm"}
# Multi-head latent attention (DeepSeek-V2/V3): queries direct or through a low-rank pair, keys and
# values from one compressed latent plus a shared rotary key.
_MLA_PARTS = {
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
}
_ROUTED_PARTS = {"gate", "router", "experts", "shared_expert", "shared_expert_gate"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head (all of them, or a part as in GLM-4.5)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat((head * cos + rotate_half(head) * sin, rest), dim=-1)


def rms_parts(norm: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of an RMSNorm-like module (a weight, an epsilon, no bias); None otherwise."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or eps is None or getattr(norm, "bias", None) is not None:
        return None
    return weight, float(eps)


Norm = tuple[torch.Tensor, float] | torch.nn.Module


@torch.inference_mode()
def read_norm(module: torch.nn.Module) -> Norm:
    """A norm as the hand-written layers apply it: (weight, eps) when the module computes a plain
    RMSNorm (checked on random input once), else the module itself (Gemma's ``x * (1 + w)``)."""
    parts = rms_parts(module)
    if parts is None:
        return module
    weight = parts[0]
    x = torch.randn(3, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    tol = 1e-5 if weight.dtype == torch.float32 else 2e-2
    return parts if torch.allclose(module(x), rms_norm(x, *parts), rtol=tol, atol=tol) else module


def apply_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    return rms_norm(x, *norm) if isinstance(norm, tuple) else norm(x)


def norm_size(norm: Norm) -> int:
    return int((norm[0] if isinstance(norm, tuple) else norm.weight).numel())


def is_silu(act: object) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_parts(rows: torch.Tensor, counts: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(expert, its rows) for the rows sorted by expert, ``counts`` rows each."""
    parts, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c:
            parts.append((e, rows[start : start + c]))
            start += c
    return parts


def swiglu(x: torch.Tensor, w: tuple) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) with the weights, biases and activation of `swiglu_weights`."""
    w_gate, w_up, w_down, b_gate, b_up, b_down, act = w
    gate = F.linear(x, w_gate, b_gate)
    return F.linear((F.silu(gate) if act is None else act(gate)) * F.linear(x, w_up, b_up), w_down, b_down)


def swiglu_weights(mlp: torch.nn.Module) -> tuple | None:
    """(gate, up, down) weights, (gate, up, down) biases and the activation (None: SiLU) of a
    gated MLP, separate (Llama) or with gate and up fused (Phi-3: views, so in-place weight updates
    show); else None."""
    act = getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))
    if not callable(act):
        return None
    act = None if is_silu(act) else act
    down = getattr(mlp, "down_proj", None)
    if not isinstance(down, torch.nn.Linear):
        return None
    if all(isinstance(getattr(mlp, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj")):
        gate, up = mlp.gate_proj, mlp.up_proj
        return gate.weight, up.weight, down.weight, gate.bias, up.bias, down.bias, act
    fused = getattr(mlp, "gate_up_proj", None)
    if isinstance(fused, torch.nn.Linear):
        w_gate, w_up = fused.weight.chunk(2, dim=0)
        b_gate, b_up = fused.bias.chunk(2) if fused.bias is not None else (None, None)
        return w_gate, w_up, down.weight, b_gate, b_up, down.bias, act
    return None


def routed_experts_fit(mlp: torch.nn.Module) -> bool:
    """A top-k router module (``gate`` or ``router``, returning logits, weights, indices) with
    experts in fused ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] (or both transposed,
    gpt-oss), optional biases, their activation SiLU-gated or the experts' own ``_apply_gate``
    (gpt-oss's clamped, interleaved one), optionally a shared SwiGLU expert with a sigmoid gate
    (Qwen2-MoE): the MoE the hand-written layers compute."""
    parts = {name for name, _ in mlp.named_children()}
    experts = getattr(mlp, "experts", None)
    if not (parts <= _ROUTED_PARTS and len(parts & {"gate", "router"}) == 1 and experts is not None):
        return False
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3):
        return False
    if getattr(experts, "is_transposed", False):  # [E, H, 2I] and [E, I, H]
        gate_up, down = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    num, hidden, inner = gate_up.shape[0], gate_up.shape[2], down.shape[2]
    biases_fit = all(
        bias is None or tuple(bias.shape) == shape
        for bias, shape in (
            (getattr(experts, "gate_up_proj_bias", None), (num, 2 * inner)),
            (getattr(experts, "down_proj_bias", None), (num, hidden)),
        )
    )
    activation_fits = callable(getattr(experts, "_apply_gate", None)) or (
        getattr(experts, "is_concatenated", True) and is_silu(getattr(experts, "act_fn", None))
    )
    return (
        gate_up.shape[1] == 2 * inner
        and tuple(down.shape[:2]) == (num, hidden)
        and biases_fit
        and activation_fits
        and ("shared_expert" not in parts or swiglu_weights(getattr(mlp, "shared_expert", None)) is not None)
    )


def layer_window(config, attn: torch.nn.Module, index: int) -> int | None:
    """Layer ``index``'s sliding window (keys at (p - window, p]), or None for full attention: the
    attention module's own word where it keeps one, else the config's."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window or None
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[index] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


class LatentAttention:
    """Multi-head latent attention's tensors (DeepSeek-V2/V3); keys and values are cached expanded,
    per head ([heads, nope + rope] keys, [heads, v] values), as the generic path caches them."""

    def __init__(self, attn: torch.nn.Module, config, heads: int):
        self.nope, self.rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.v_dim, self.rank, self.heads = int(config.v_head_dim), int(config.kv_lora_rank), heads
        q_proj = getattr(attn, "q_proj", None)
        self.q = (q_proj.weight, q_proj.bias) if q_proj is not None else None
        if self.q is None:
            self.q_a = (attn.q_a_proj.weight, attn.q_a_proj.bias)
            self.q_a_norm, self.q_b = read_norm(attn.q_a_layernorm), attn.q_b_proj.weight
        self.kv_a = (attn.kv_a_proj_with_mqa.weight, attn.kv_a_proj_with_mqa.bias)
        self.kv_a_norm, self.kv_b = read_norm(attn.kv_a_layernorm), attn.kv_b_proj.weight
        # Rotary dims in interleaved pairs (x0, x1), (x2, x3)...: DeepSeek's own layout.
        self.interleaved = bool(getattr(config, "rope_interleave", True))

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s_tokens = h.shape[0]
        if self.q is not None:
            q = F.linear(h, *self.q)
        else:
            q = F.linear(apply_norm(F.linear(h, *self.q_a), self.q_a_norm), self.q_b)
        q_pass, q_rot = q.view(s_tokens, self.heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rot = F.linear(h, *self.kv_a).split([self.rank, self.rope], dim=-1)
        kv = F.linear(apply_norm(latent, self.kv_a_norm), self.kv_b).view(s_tokens, self.heads, self.nope + self.v_dim)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = k_rot[:, None]
        if self.interleaved:  # pairs -> halves; q and k alike, so their dot products are unchanged
            q_rot = torch.cat((q_rot[..., 0::2], q_rot[..., 1::2]), dim=-1)
            k_rot = torch.cat((k_rot[..., 0::2], k_rot[..., 1::2]), dim=-1)
        q_rot, k_rot = rope(q_rot, cos, sin), rope(k_rot, cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(s_tokens, self.heads, self.rope)), dim=-1)
        return q, k, v


class LayerTensors:
    """The tensors one decoder layer needs, read from its modules once (views, never copies)."""

    def __init__(self, layer: torch.nn.Module, config, index: int, heads: int, kv_heads: int, head_dim: int):
        attn = layer.self_attn
        self.norm_in, self.norm_post = read_norm(layer.input_layernorm), read_norm(layer.post_attention_layernorm)
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        # Sandwich (Gemma): norm_post norms the attention output, then norm_ff_in and norm_ff_out
        # go around the MLP; otherwise norm_post is the MLP's input norm.
        self.norm_ff_in = read_norm(layer.pre_feedforward_layernorm) if sandwich else None
        self.norm_ff_out = read_norm(layer.post_feedforward_layernorm) if sandwich else None
        self.mla = LatentAttention(attn, config, heads) if hasattr(attn, "kv_a_proj_with_mqa") else None
        self.kv_shape = (kv_heads, head_dim, head_dim)  # cached (kv heads, key dim, value dim)
        if self.mla is not None:
            self.kv_shape = (heads, self.mla.nope + self.mla.rope, self.mla.v_dim)
        elif hasattr(attn, "qkv_proj"):  # fused (Phi-3)
            sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
            self.wq, self.wk, self.wv = attn.qkv_proj.weight.split(sizes)
            bias = attn.qkv_proj.bias
            self.bq, self.bk, self.bv = bias.split(sizes) if bias is not None else (None, None, None)
        else:
            self.wq, self.bq = attn.q_proj.weight, attn.q_proj.bias
            self.wk, self.bk = attn.k_proj.weight, attn.k_proj.bias
            self.wv, self.bv = attn.v_proj.weight, attn.v_proj.bias
        self.wo, self.bo = attn.o_proj.weight, attn.o_proj.bias
        # q/k RMSNorm per head (Qwen3) or over the whole projection (OLMoE), by the weight's size.
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = None if q_norm is None else read_norm(q_norm)
        self.k_norm = None if k_norm is None else read_norm(k_norm)
        self.qk_norm_per_head = q_norm is not None and norm_size(self.q_norm) == head_dim
        self.scaling = float(getattr(attn, "scaling", None) or head_dim**-0.5)
        self.softcap = getattr(attn, "attn_logit_softcapping", None)
        self.sinks = getattr(attn, "sinks", None)
        self.window = layer_window(config, attn, index)
        types = getattr(config, "layer_types", None)
        self.layer_type = types[index] if types else "full_attention"
        mlp = layer.mlp
        self.mlp_module = None  # run the model's own MLP module (an MoE layout not written here)
        self.router = None
        self.shared = self.shared_gate = None
        if hasattr(mlp, "experts") and routed_experts_fit(mlp):
            experts = mlp.experts
            self.router = mlp.gate if hasattr(mlp, "gate") else mlp.router
            # Per expert [in, out] views for x @ W: [E, H, 2I] and [E, I, H].
            self.gate_up, self.down = experts.gate_up_proj, experts.down_proj
            if not getattr(experts, "is_transposed", False):
                self.gate_up, self.down = self.gate_up.transpose(-2, -1), self.down.transpose(-2, -1)
            self.gate_up_bias = getattr(experts, "gate_up_proj_bias", None)
            self.down_bias = getattr(experts, "down_proj_bias", None)
            # The experts' own activation of [gate; up] (or gate/up interleaved, clamped: gpt-oss).
            self.apply_gate = getattr(experts, "_apply_gate", None)
            self.num_experts = int(self.gate_up.shape[0])
            if getattr(mlp, "shared_expert", None) is not None:
                self.shared = swiglu_weights(mlp.shared_expert)
                gate = getattr(mlp, "shared_expert_gate", None)
                self.shared_gate = None if gate is None else (gate.weight, gate.bias)
        elif not hasattr(mlp, "experts") and (dense := swiglu_weights(mlp)) is not None:
            self.dense = dense
        else:
            self.mlp_module = mlp


def hand_written_misfit(model: torch.nn.Module) -> str | None:
    """Why this model cannot take the hand-written layers, or None. They fit any decoder whose
    layers are pre-norm RMSNorm -> attention (separate or fused q/k/v projections, optional q/k
    norms, biases, sliding windows, sinks, partial RoPE) -> RMSNorm -> MLP; SwiGLU MLPs and the
    usual routed MoE are written out, any other MLP runs as the model's own module. The numbers
    are checked after this (logits against the model's own forward)."""
    config = model.config
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"model.model has no {name}"
    if getattr(model, "lm_head", None) is None:
        return "no lm_head"
    if getattr(config, "clip_qkv", None) is not None:
        return "clip_qkv is set"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not types <= {"full_attention", "sliding_attention"}:
        return f"attention layer types {sorted(types)}"
    for layer in inner.layers:
        parts = {n for n, m in layer.named_children() if not isinstance(m, torch.nn.Dropout)}
        if parts not in (_LAYER_PARTS, _SANDWICH_PARTS):
            return f"decoder layer parts {sorted(parts ^ _LAYER_PARTS)} (not pre-norm attention + MLP)"
        attn = layer.self_attn
        attn_parts = {n for n, _ in attn.named_children()}
        known = _MLA_PARTS if "kv_a_proj_with_mqa" in attn_parts else _ATTENTION_PARTS
        if not attn_parts <= known:
            return f"attention parts {sorted(attn_parts - known)}"
        if known is _MLA_PARTS:
            if not all(hasattr(config, n) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")):
                return "latent attention without qk_nope_head_dim / qk_rope_head_dim / v_head_dim in its config"
        elif "qkv_proj" not in attn_parts and not {"q_proj", "k_proj", "v_proj"} <= attn_parts:
            return "attention without q/k/v projections"
        own = {n for n, _ in attn.named_parameters(recurse=False)} - {"sinks"}
        if own:
            return f"attention parameters {sorted(own)}"
    return None
