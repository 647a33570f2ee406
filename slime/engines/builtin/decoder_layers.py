"""What the hand-written layers (`slime.engines.builtin.fast_decoder`) read from a model: which decoders fit,
by their modules rather than their model type (:func:`hand_written_misfit`), and each layer's
tensors (:class:`LayerTensors`: views of the model's own parameters, so an in-place weight update
is seen at once), with the small maths the layers share (RMSNorm, RoPE, gated MLPs).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from slime.engines.builtin.decoder_tree import (
    GATE_ACTIVATIONS,
    IDLE,
    DecoderTrace,
    LayerFlow,
    is_norm,
    read_linear,
    rms_parts,
    trace_decoder,
)
from slime.engines.builtin.rotary import rope, rope_pairs

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
_SHARED = ("shared_expert", "shared_experts")  # Qwen2-MoE's name, GLM-4.5's and DeepSeek's
_ROUTED_PARTS = {"gate", "router", "experts", "shared_expert", "shared_experts", "shared_expert_gate"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


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


def apply_norm(x: torch.Tensor, norm: Norm | None) -> torch.Tensor:
    if norm is None:
        return x
    return rms_norm(x, *norm) if isinstance(norm, tuple) else norm(x)


def norm_size(norm: Norm) -> int | None:
    """How many features the norm's weight scales (None: it has none, as nanochat's)."""
    weight = norm[0] if isinstance(norm, tuple) else getattr(norm, "weight", None)
    return None if weight is None else int(weight.numel())


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
    parts = {n for n, c in mlp.named_children() if not isinstance(c, IDLE)}
    if parts - {"gate_proj", "up_proj", "gate_up_proj", "down_proj", "act_fn", "activation_fn"}:
        return None  # something more in between (BitNet's ffn_sub_norm): the module runs itself
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
    router = getattr(mlp, "gate", None) if "gate" in parts else getattr(mlp, "router", None)
    wanted = [
        p
        for p in inspect.signature(router.forward).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(wanted) != 1:  # the router reads more than the hidden states (MiniMax-M2's score correction)
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
        and all(name not in parts or swiglu_weights(getattr(mlp, name)) is not None for name in _SHARED)
        and len(parts & set(_SHARED)) <= 1
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
        turn = rope_pairs if self.interleaved else rope  # the layer's `rotary` mode, with the matching tables
        q_rot, k_rot = turn(q_rot, cos, sin), turn(k_rot, cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(s_tokens, self.heads, self.rope)), dim=-1)
        return q, k, v


class LayerTensors:
    """The tensors one decoder layer needs, read from its modules once (views, never copies)."""

    def __init__(
        self, layer: torch.nn.Module, flow: LayerFlow, config, index: int, heads: int, kv_heads: int, head_dim: int
    ):
        attn = getattr(layer, flow.attn)
        self.flow = flow
        # The norms on the attention's and the MLP's inputs and outputs (None: not there).
        self.attn_in, self.attn_out, self.mlp_in, self.mlp_out = (
            None if name is None else read_norm(getattr(layer, name))
            for name in (flow.attn_in, flow.attn_out, flow.mlp_in, flow.mlp_out)
        )
        self.mla = LatentAttention(attn, config, heads) if hasattr(attn, "kv_a_proj_with_mqa") else None
        # One q/k/v projection: "contiguous", "per_head" or "columns" (FastDecoder.fit_attention)
        self.fused = None
        self.qkv_columns: torch.Tensor | None = None  # "columns": the [q; k; v] order of its outputs
        self.loose_norms: list[Norm] = []
        self.q_norm = self.k_norm = None
        if self.mla is not None:
            # cached per position: (kv heads, key dim, value dim)
            self.kv_shape = (heads, self.mla.nope + self.mla.rope, self.mla.v_dim)
            self.wo, self.bo = attn.o_proj.weight, attn.o_proj.bias
        else:
            projections = [read_linear(getattr(attn, name)) for name in flow.qkv]
            if len(projections) == 3:  # in the order the model calls them; the fit may swap q and k
                self.separate = projections
                (self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv) = projections
                # kv heads and the value's size per layer, from the weights (MiMo-V2's differ)
                self.kv_heads = int(self.wk.shape[0]) // head_dim
                self.v_dim = int(self.wv.shape[0]) // self.kv_heads
            else:  # fused [q; k; v] (Phi-3, GPT-2, Falcon) or per kv head [q..., k, v] (GPT-NeoX)
                (self.w_qkv, self.b_qkv), self.fused = projections[0], "contiguous"
                self.kv_heads = (int(self.w_qkv.shape[0]) - heads * head_dim) // (2 * head_dim)
                self.v_dim = head_dim
            self.kv_shape = (self.kv_heads, head_dim, self.v_dim)
            self.wo, self.bo = read_linear(getattr(attn, flow.out))
            # q/k RMSNorm per head (Qwen3) or over the whole projection (OLMoE), by the weight's size.
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.q_norm = None if q_norm is None else read_norm(q_norm)
            self.k_norm = None if k_norm is None else read_norm(k_norm)
            # Per-head norms under other names (HunYuan's query_layernorm, Persimmon's LayerNorms):
            # FastDecoder.fit_attention finds which one the queries and which one the keys go through.
            self.loose_norms = [
                read_norm(child)
                for name, child in attn.named_children()
                if name not in ("q_norm", "k_norm", flow.out_norm) and is_norm(child)
            ]
        # Between the attention and its output projection: a norm (BitNet), a gate (AFMoE, Laguna).
        self.out_norm = None if flow.out_norm is None else read_norm(getattr(attn, flow.out_norm))
        self.out_gate = None
        if flow.out_gate is not None:
            self.out_gate = (*read_linear(getattr(attn, flow.out_gate)), GATE_ACTIVATIONS[flow.gate_activation])
        qk_norms = [n for n in (self.q_norm, self.k_norm, *self.loose_norms) if n is not None]
        self.qk_norm_per_head = any(norm_size(n) == head_dim for n in qk_norms)
        # Norms without a weight (nanochat) say nothing of their scope: fit_attention tries both.
        self.qk_norm_scope_unknown = bool(qk_norms) and all(norm_size(n) is None for n in qk_norms)
        # Set by FastDecoder.fit_attention from the model: RoPE's mode (ROTARY_MODES), q/k norms
        # before the rotation (Qwen3) or after it (HunYuan), the scale on the values.
        self.rotary = "pairs" if self.mla is not None and self.mla.interleaved else "halves"
        self.qk_norm_after_rotary = False
        self.rotary_sign = 1  # -1: RoPE turns by minus the angle (nanochat)
        self.v_scale = 1.0
        # The scale the attention hands its attention function; fit_attention folds in a scale the
        # model puts on its queries before (OPT).
        self.attention_scaling = flow.scaling or float(getattr(attn, "scaling", None) or head_dim**-0.5)
        self.scaling = self.attention_scaling
        self.softcap = getattr(attn, "attn_logit_softcapping", None)
        self.sinks = getattr(attn, "sinks", None)
        self.window = layer_window(config, attn, index)
        types = getattr(config, "layer_types", None)
        self.layer_type = types[index] if types else "full_attention"
        self.mlp_module = None  # run the model's own MLP module (an MoE layout not written here)
        self.router = None
        self.shared = self.shared_gate = None
        self.plain = None  # linear, activation, linear: the layer's own children (OPT)
        if flow.mlp_chain:
            first, act, last = (getattr(layer, n) for n in flow.mlp_chain)
            self.plain = (*read_linear(first), act, *read_linear(last))
            return
        mlp = getattr(layer, flow.mlp)
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
            shared = next((getattr(mlp, n) for n in _SHARED if getattr(mlp, n, None) is not None), None)
            if shared is not None:  # one SwiGLU every token takes (Qwen2-MoE's gated, GLM-4.5's and DeepSeek's not)
                self.shared = swiglu_weights(shared)
                gate = getattr(mlp, "shared_expert_gate", None)
                self.shared_gate = None if gate is None else (gate.weight, gate.bias)
        elif not hasattr(mlp, "experts") and (dense := swiglu_weights(mlp)) is not None:
            self.dense = dense
        else:
            self.mlp_module = mlp


def _loose_qk_norms(attn: torch.nn.Module, loose: set[str], head_dim: int) -> bool:
    """Whether the attention's parts ``loose`` can be q/k norms under other names (HunYuan,
    Persimmon): at most two norms of one head's size, beside no q_norm / k_norm. Which is whose,
    if either, `FastDecoder.fit_attention` finds out."""
    if len(loose) > 2 or {"q_norm", "k_norm"} & {n for n, _ in attn.named_children()}:
        return False
    return all(is_norm(part := getattr(attn, n)) and norm_size(read_norm(part)) == head_dim for n in loose)


def hand_written_misfit(model: torch.nn.Module, trace: DecoderTrace | None = None) -> str | None:
    """Why this model cannot take the hand-written layers, or None. They fit any decoder whose
    layers are attention (separate or fused q/k/v projections, nn.Linear or GPT-2's Conv1D,
    optional q/k norms, biases, sliding windows, sinks, partial RoPE or none, learned absolute
    positions) and one MLP around a residual stream, with norms on either's input or output
    wherever the layer applies them (pre-norm, post-norm as OLMo 2, both as Gemma), the MLP after
    the attention or beside it (Cohere, GPT-NeoX), the branches scaled (Granite): `trace_decoder`
    finds the parts and reads that flow off one traced forward. SwiGLU MLPs and the usual routed
    MoE are written out, any other MLP runs as the model's own module. The numbers are checked
    after this (logits against the model's own forward)."""
    config = model.config
    if getattr(config, "clip_qkv", None) is not None:
        return "clip_qkv is set"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not types <= {"full_attention", "sliding_attention"}:
        return f"attention layer types {sorted(types)}"
    trace = trace_decoder(model) if trace is None else trace  # ``trace``: the model's, already taken
    if isinstance(trace, str):
        return trace
    try:
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    except Exception as exc:  # a config whose layers differ (per-layer attributes)
        return f"no one head size: {type(exc).__name__}"
    for i, (layer, flow) in enumerate(zip(trace.layer_modules, trace.layers)):
        attn = getattr(layer, flow.attn)
        parts = {n for n, c in attn.named_children() if not isinstance(c, IDLE)}
        if "kv_a_proj_with_mqa" in parts:  # latent attention, read by its parts' names
            if parts - _MLA_PARTS:
                return f"attention parts {sorted(parts - _MLA_PARTS)}"
            if not all(hasattr(config, n) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")):
                return "latent attention without qk_nope_head_dim / qk_rope_head_dim / v_head_dim in its config"
        else:
            if len(flow.qkv) not in (1, 3) or flow.out is None:
                return (
                    f"layer {i}: attention with {len(flow.qkv)} linear maps of its input and "
                    f"{'no single' if flow.out is None else 'one'} output projection (one fused or three q/k/v expected)"
                )
            loose = parts - set(flow.qkv) - {flow.out, flow.out_norm, flow.out_gate, "q_norm", "k_norm"}
            if loose and not _loose_qk_norms(attn, loose, head_dim):
                return f"attention parts {sorted(loose)}"
        own = {n for n, _ in attn.named_parameters(recurse=False)} - {"sinks"}
        if own:
            return f"attention parameters {sorted(own)}"
    return None
