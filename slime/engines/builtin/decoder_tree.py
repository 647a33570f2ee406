"""A decoder's parts found by their place in the data flow, not by their names: one traced
forward (`trace_decoder`) finds the token embedding, a learned position table if any, the layer
list, the rotary module if any, the final norm and the head; in each layer the attention (the
child the model's attention function is called from), its q/k/v projections (the ones that read
the attention's input, in the order the model calls them; one fused or three), its output
projection, its norms, the MLP, and where the layer applies its norms (`LayerFlow`). Llama's
``model.model.embed_tokens`` tree and GPT-2's ``transformer.wte`` / ``wpe`` / ``h`` / ``ln_f``
with ``Conv1D`` projections read alike. The hand-written layers
(`slime.engines.builtin.decoder_layers`) compute what this finds; the start-up logit check judges.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

# Children that do nothing in eval.
IDLE = (torch.nn.Dropout, torch.nn.Identity)
_TRACE = "slime_trace"
_traced = threading.local()  # .calls: [attention module, scaling, output] per attention-function call


def attention_softmax(
    scores: torch.Tensor, bias: torch.Tensor, softcap: float | None, sinks: torch.Tensor | None
) -> torch.Tensor:
    """softmax(scores + bias) over the last dim, with logit soft-capping and attention sinks: the
    hand-written layers' attention, the packed learner's, and the trace's below."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + bias
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype)[..., None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _traced_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, s_aux=None, **kwargs
):
    """Plain attention (eager's additive mask, logit soft-capping, sinks), recording which module
    called it, with which scale, and what it returned. query [B, heads, S, D], key/value [B, kv
    heads, L, D*]."""
    call = [module, scaling, None]
    _traced.calls.append(call)
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = (query.float() @ key.float().transpose(-1, -2)) * (
        scaling if scaling is not None else query.shape[-1] ** -0.5
    )
    mask = 0.0 if attention_mask is None else attention_mask[..., : key.shape[-2]].float()
    probs = attention_softmax(scores, mask, softcap, None if s_aux is None else s_aux.float().view(-1, 1))
    out = (probs.to(value.dtype) @ value).transpose(1, 2).contiguous()
    call[2] = out.clone()  # [B, S, heads, Dv]: what the output projection should read, or its input's source
    return out, None


AttentionInterface.register(_TRACE, _traced_attention)
AttentionMaskInterface.register(_TRACE, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run the model's attention modules through ``name`` (the setter reaches every sub-config;
    a config without sub-configs is set directly, once per forward being the hot path)."""
    config = model.config
    previous = config._attn_implementation
    direct = not getattr(config, "sub_configs", None) and hasattr(config, "_attn_implementation_internal")
    if direct:
        config._attn_implementation_internal = name
    else:
        config._attn_implementation = name
    try:
        yield
    finally:
        if direct:
            config._attn_implementation_internal = previous
        else:
            config._attn_implementation = previous


@torch.inference_mode()
def read_linear(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [out, in], bias) with ``module(x) == F.linear(x, weight, bias)``: nn.Linear's own,
    or a view of GPT-2's transposed ``Conv1D`` weight (checked on random input once); None when
    the module computes no plain linear map."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or list(module.children()):
        return None
    if bias is not None and not isinstance(bias, torch.Tensor):
        return None
    tol = 1e-4 if weight.dtype == torch.float32 else 3e-2
    g = torch.Generator().manual_seed(0)
    for w in (weight, weight.t()):
        x = torch.randn(2, w.shape[1], generator=g).to(weight.device, weight.dtype)
        try:
            got = module(x)
        except Exception:  # the input size fits the other orientation only
            continue
        if got.shape == (2, w.shape[0]) and torch.allclose(got, F.linear(x, w, bias), rtol=tol, atol=tol):
            return w, bias
    return None


def rms_parts(norm: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of an RMSNorm-like module (a weight, an epsilon, no bias); None otherwise."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or eps is None or getattr(norm, "bias", None) is not None:
        return None
    return weight, float(eps)


def is_norm(module: torch.nn.Module) -> bool:
    """A leaf module with an RMSNorm's parts or a norm's class name (LayerNorm, Gemma's RMSNorm)."""
    leaf = not list(module.children())
    return leaf and (rms_parts(module) is not None or "norm" in type(module).__name__.lower())


def scale_between(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """s with y == s * x (None if y is no multiple of x), within float32's rounding, or bf16's
    where either tensor is in a lower precision."""
    wide = (torch.float32, torch.float64)
    tol = (1e-4, 1e-5) if x.dtype in wide and y.dtype in wide else (2e-2, 1e-3)
    x, y = x.double(), y.double()
    s = float((x * y).sum() / (x * x).sum().clamp_min(1e-30))
    return s if torch.allclose(y, s * x, rtol=tol[0], atol=tol[1]) else None


@dataclass
class LayerFlow:
    """Where a decoder layer applies its norms, found by tracing it (`trace_decoder`): the names of
    the attention, of the norms on the attention's input and output and on the MLP's input and
    output (None: no norm there), the MLP's name, whether the MLP runs beside the attention
    (parallel: it reads the attention's input, Cohere, or the layer's input through a norm of its
    own, GPT-NeoX) rather than the residual after it, and the scale on each branch before the
    residual add (Granite); an MLP whose parts the layer calls itself (OPT) has the name "" and its
    parts in ``mlp_chain``. In the attention: its q/k/v projections in the order the model calls
    them (one fused or three), its output projection, and the scale it hands its attention
    function (None: it hands none)."""

    mlp: str
    attn: str = "self_attn"
    attn_in: str | None = None
    attn_out: str | None = None
    mlp_in: str | None = None
    mlp_out: str | None = None
    parallel: bool = False
    residual_scale: float = 1.0
    qkv: list[str] = field(default_factory=list)
    out: str | None = None
    scaling: float | None = None
    mlp_chain: list[str] | None = None  # the MLP is these children of the layer (linear, activation, linear)
    out_norm: str | None = None  # a norm between the attention function and the output projection
    out_gate: str | None = None  # a gate on the attention's output: this linear map of its input
    gate_activation: str = "sigmoid"  # ... through this (`GATE_ACTIVATIONS`)


@dataclass
class DecoderTrace:
    """A decoder's parts and data flow: each layer's `LayerFlow`, the token embedding, a learned
    position table (and the index of position 0 in it) if the model adds one, the layer list, the
    rotary module (None: no RoPE), the final norm and the head, a norm before the first layer if
    any; the scale between the embedding (plus positions) and the first layer (or its norm) (Granite's embedding_multiplier) and between the head and
    the logits."""

    layers: list[LayerFlow] = field(default_factory=list)
    embed_scale: float = 1.0
    logit_scale: float = 1.0
    embed: torch.nn.Module | None = None
    positions: torch.Tensor | None = None
    position_offset: int = 0
    layer_modules: list[torch.nn.Module] = field(default_factory=list)
    rotary: torch.nn.Module | None = None
    final_norm: torch.nn.Module | None = None
    head: torch.nn.Module | None = None
    embed_norm: torch.nn.Module | None = None  # a norm between the embedding and the first layer (nanochat)


def _rotary_table(output: object) -> bool:
    """Whether a module's output is a rotary table: (cos, sin), or e^(i angle) (DeepSeek-V2)."""
    if isinstance(output, torch.Tensor):
        return output.is_complex()
    return isinstance(output, tuple) and len(output) == 2 and all(isinstance(t, torch.Tensor) for t in output)


def _same_tables(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _copy(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _same(a: object, b: object) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.numel() == b.numel()
        and torch.equal(a.reshape(b.shape), b)
    )


def _first(value: object) -> object:
    return value[0] if isinstance(value, tuple) else value


def _layer_flow(
    layer: torch.nn.Module,
    attn: str,
    calls: dict[str, tuple],
    x: torch.Tensor,
    x_value: torch.Tensor,
    out: torch.Tensor,
) -> LayerFlow | str:
    """The flow of one traced layer (``calls``: child name -> (input, output, their values as
    traced); ``attn``: the attention child's name; ``x``: the layer's input, ``x_value`` and
    ``out``: its input's and output's values), checked by recomputing the layer's output from the
    traced pieces; or why it is none."""
    norms = [n for n in calls if n != attn and is_norm(getattr(layer, n))]
    others = [n for n in calls if n != attn and n not in norms]
    chain = _mlp_chain(layer, others, calls)
    if len(others) != 1 and chain is None:
        return f"decoder layer parts {sorted(others)} besides the attention and norms (one MLP expected)"
    flow = LayerFlow(mlp=others[0], attn=attn)
    if chain is not None:  # the layer calls the MLP's parts itself (OPT): one MLP made of them
        first, last = calls[chain[0]], calls[chain[-1]]
        calls = {**calls, "": (first[0], last[1], first[2], last[3])}
        flow.mlp, flow.mlp_chain = "", chain
    (a_in, a_out, _, _), (m_in, m_out, _, _) = calls[attn], calls[flow.mlp]
    for name in norms:
        n_in, n_out, _, _ = calls[name]
        role = (
            "attn_in"
            if n_out is a_in
            else "attn_out"
            if n_in is a_out
            else "mlp_in"
            if n_out is m_in
            else "mlp_out"
            if n_in is m_out
            else None
        )
        if role is None or getattr(flow, role) is not None:
            return f"norm {name} is not on the attention's or the MLP's input or output"
        setattr(flow, role, name)
    own_norm_beside = flow.mlp_in is not None and calls[flow.mlp_in][0] is x  # GPT-NeoX's parallel residual
    flow.parallel = m_in is a_in or own_norm_beside
    if not _replays(flow, calls, x_value, out):
        flow.residual_scale = _residual_scale(layer, flow, calls, x_value, out)
        if flow.residual_scale is None or not _replays(flow, calls, x_value, out):
            return "the layer's output is no residual sum of its traced parts"
    return flow


# What an output gate may apply to its projection before it scales the attention's output.
GATE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "softplus": F.softplus}


def _output_path(flow: LayerFlow, attn: torch.nn.Module, parts: dict[str, tuple], attended: torch.Tensor) -> str | None:
    """Between the attention function's output (``attended`` [S, heads * Dv]) and the output
    projection: nothing, a norm of the attention's own (BitNet's ``attn_sub_norm``), or a gate, one
    more linear map of the attention's input through a sigmoid or a softplus, over the whole output
    or one per head (AFMoE, Laguna); the gate leaves ``flow.qkv``. None, or why the output
    projection reads something else."""
    o_in = parts[flow.out][2].reshape(attended.shape)
    if nearly_equal(o_in, attended):
        return None
    for name, (_, _, n_in, n_out) in parts.items():
        module = getattr(attn, name)
        if is_norm(module) and nearly_equal(n_in, attended) and nearly_equal(n_out, o_in):
            flow.out_norm = name
            return None
    heads = attended.shape[-1] // getattr(attn, "head_dim", attended.shape[-1])
    best: tuple = (float("inf"), None, None)  # the closest (linear map, activation), if close enough
    for name in flow.qkv:
        gate_out = parts[name][3].reshape(attended.shape[0], -1).float()
        if gate_out.shape[-1] not in (attended.shape[-1], heads):
            continue
        for act_name, act in GATE_ACTIVATIONS.items():
            gate = act(gate_out)
            if gate.shape[-1] != attended.shape[-1]:  # one gate per head, over its values
                gate = gate.repeat_interleave(attended.shape[-1] // gate.shape[-1], dim=-1)
            gated = (attended.float() * gate).to(o_in.dtype)
            error = float((gated.float() - o_in.float()).abs().max())
            if error < best[0] and nearly_equal(gated, o_in):
                best = (error, name, act_name)
    if best[1] is None:
        return "the output projection reads neither the attention's output nor a norm or gate of it"
    _, flow.out_gate, flow.gate_activation = best
    flow.qkv = [n for n in flow.qkv if n != flow.out_gate]
    return None


def nearly_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal within float32's rounding, or bf16's where either is in a lower precision (a sum in
    another order: GPT-NeoX adds its two branches to the residual at once)."""
    if a.numel() != b.numel():
        return False
    a, wide = a.reshape(b.shape), {a.dtype, b.dtype} <= {torch.float32, torch.float64}
    if wide:
        return torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    scale = float(b.float().abs().max())  # bf16's error is relative to the tensor's size
    return torch.allclose(a.float(), b.float(), rtol=3e-2, atol=3e-2 * scale)


def _mlp_chain(layer: torch.nn.Module, others: list[str], calls: dict[str, tuple]) -> list[str] | None:
    """A linear map, an activation (no parameters) and a linear map called one on the other's output,
    in that order: an MLP whose parts are the layer's own children (OPT, BioGPT)."""
    if len(others) != 3:
        return None
    first, act, last = (getattr(layer, n) for n in others)
    linked = calls[others[1]][0] is calls[others[0]][1] and calls[others[2]][0] is calls[others[1]][1]
    plain = read_linear(first) is not None and read_linear(last) is not None and not list(act.parameters())
    return others if linked and plain else None


def _branches(flow: LayerFlow, calls: dict[str, tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention's and the MLP's branch as traced (after their output norms, if any), and the MLP's input."""
    att = calls[flow.attn_out][3] if flow.attn_out else calls[flow.attn][3]
    mlp = calls[flow.mlp_out][3] if flow.mlp_out else calls[flow.mlp][3]
    m_in = calls[flow.mlp_in][2] if flow.mlp_in else calls[flow.mlp][2]
    return att, mlp.reshape(att.shape), m_in.reshape(att.shape)


def _residual_scale(
    layer: torch.nn.Module, flow: LayerFlow, calls: dict[str, tuple], x: torch.Tensor, out: torch.Tensor
) -> float | None:
    """s in x + s * branch, read off the traced values (Granite's residual_multiplier, MiniCPM's
    scale_depth / sqrt(layers)): what the attention's branch adds to the MLP's input, or both
    branches to the output where they run side by side. A float attribute of the layer equal to it
    within bf16's rounding is taken as the exact value."""
    att, mlp, m_in = _branches(flow, calls)
    fitted = scale_between(att + mlp, out - x) if flow.parallel else scale_between(att, m_in - x)
    if fitted is None or fitted == 0.0:
        return None
    exact = [v for v in vars(layer).values() if isinstance(v, float) and abs(v - fitted) <= 1e-2 * abs(fitted)]
    return exact[0] if len(exact) == 1 else fitted


def _replays(flow: LayerFlow, calls: dict[str, tuple], x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether x + s * attention branch (+ s * MLP branch) gives the layer's traced output."""
    s = flow.residual_scale
    att, mlp, m_in = _branches(flow, calls)
    mid = x + s * att
    if not flow.parallel and not nearly_equal(m_in, mid):
        return False
    return nearly_equal(mid + s * mlp, out)


def _decoder_layers(
    model: torch.nn.Module, embed: torch.nn.Module
) -> tuple[torch.nn.Module, torch.nn.ModuleList] | str:
    """The module that holds the token embedding and the layer list (its one ModuleList with
    parameters: Granite-SWA keeps its rotary modules in another)."""
    base = next((m for m in model.modules() if any(c is embed for c in m.children())), None)
    children = list(base.children()) if base is not None else []
    lists = [c for c in children if isinstance(c, torch.nn.ModuleList) and any(True for _ in c.parameters())]
    if len(lists) != 1:
        return "no single layer list beside the token embedding"
    return base, lists[0]


@torch.inference_mode()
def trace_decoder(model: torch.nn.Module) -> DecoderTrace | str:
    """Run three tokens through ``model`` with hooks on its parts and read off the decoder's
    parts and each layer's `LayerFlow`; or why the decoder is not embedding (+ positions) / layers
    of norm, attention, norm, MLP around a residual stream / final norm / head."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embed, torch.nn.Embedding) or not isinstance(head, torch.nn.Linear):
        return "no token embedding table and linear head"
    found = _decoder_layers(model, embed)
    if isinstance(found, str):
        return found
    base, layers = found
    seen: dict = {"layers": [{} for _ in layers], "base": {}, "attn": [{} for _ in layers]}

    def child_hook(store: dict, name: str, whole: bool = False):
        def hook(module, args, kwargs, output):
            hidden = args[0] if args else next(iter(kwargs.values()), None)
            output = output if whole else _first(output)
            # The tensors themselves (whose is whose) and their values now: a later in-place op
            # (Falcon's ``mlp_output += attention_output``) must not change what was traced.
            store.setdefault(name, []).append((hidden, output, _copy(hidden), _copy(output)))

        return hook

    def layer_hook(i: int):
        def hook(module, args, kwargs, output):
            hidden, output = args[0] if args else kwargs.get("hidden_states"), _first(output)
            seen.setdefault("io", {})[i] = (hidden, _copy(hidden), _copy(output))

        return hook

    handles = [embed.register_forward_hook(lambda m, a, o: seen.setdefault("embed", o))]
    handles.append(head.register_forward_hook(lambda m, a, o: seen.setdefault("head", (a[0], o)) and None))
    inside_layers = {id(m) for m in layers.modules()}
    for name, child in base.named_modules():  # rotary modules may sit in a list of their own (Granite-SWA)
        if name and child is not embed and id(child) not in inside_layers and not isinstance(child, IDLE):
            handles.append(child.register_forward_hook(child_hook(seen["base"], name, whole=True), with_kwargs=True))
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(layer_hook(i), with_kwargs=True))
        for name, child in layer.named_children():
            if not isinstance(child, IDLE):
                handles.append(child.register_forward_hook(child_hook(seen["layers"][i], name), with_kwargs=True))
                for part, grandchild in child.named_children():
                    hook = child_hook(seen["attn"][i], f"{name}.{part}")
                    handles.append(grandchild.register_forward_hook(hook, with_kwargs=True))
    device = head.weight.device
    _traced.calls = []
    try:
        with attention_implementation(model, _TRACE):
            logits = model(input_ids=torch.tensor([[1, 2, 3]], device=device), use_cache=False).logits
        attention_calls = list(_traced.calls)
    except Exception as exc:  # a layout the hooks or the traced attention do not serve
        return f"traced forward: {type(exc).__name__}: {exc}"
    finally:
        _traced.calls = []
        for handle in handles:
            handle.remove()
    return _read_trace(model, seen, base, layers, embed, head, logits, attention_calls)


def _read_trace(model, seen: dict, base, layers, embed, head, logits, attention_calls) -> DecoderTrace | str:
    trace = DecoderTrace(embed=embed, head=head, layer_modules=list(layers))
    if len(attention_calls) != len(layers):
        return f"{len(attention_calls)} attention calls for {len(layers)} layers (one each expected)"
    for i, calls in enumerate(seen["layers"]):
        if any(len(c) != 1 for c in calls.values()):
            return f"layer {i} calls a part more than once"
        module, scaling, attended = attention_calls[i]
        attn = next((n for n, c in layers[i].named_children() if c is module or module in c.modules()), None)
        if attn not in calls:
            return f"layer {i}'s attention function is called from no child of the layer"
        flow = _layer_flow(layers[i], attn, {n: c[0] for n, c in calls.items()}, *seen["io"][i])
        if isinstance(flow, str):
            return f"layer {i}: {flow}"
        flow.scaling = None if scaling is None else float(scaling)
        a_in, attn_module = calls[attn][0][0], getattr(layers[i], attn)
        parts = {n.split(".", 1)[1]: c[0] for n, c in seen["attn"][i].items() if n.startswith(f"{attn}.")}
        linear = {n for n in parts if read_linear(getattr(attn_module, n)) is not None}
        flow.qkv = [n for n, p in parts.items() if n in linear and p[0] is a_in]
        outs = [n for n, p in parts.items() if n in linear and p[0] is not a_in]
        flow.out = outs[0] if len(outs) == 1 else None
        if flow.out is not None and "kv_a_proj_with_mqa" not in parts:
            reason = _output_path(flow, attn_module, parts, attended[0].flatten(-2))
            if reason is not None:
                return f"layer {i}: {reason}"
        trace.layers.append(flow)
    # Base parts besides the embedding and the layers: the final norm reads the last layer's output
    # and feeds the head; a position table adds to the embedding; a rotary module gives (cos, sin).
    last_out = seen["io"][len(layers) - 1][2]
    head_in, head_out = seen["head"]
    pos_out = None
    rotary_tables, embed_norm_in = [], None
    head_input_scale = 1.0  # the head reads the final norm's output times this (MiniCPM: 1 / width multiplier)
    head_has_bias = getattr(model.get_output_embeddings(), "bias", None) is not None
    for name, calls in seen["base"].items():
        child, output = base.get_submodule(name), calls[0][3]
        if _rotary_table(output):
            trace.rotary = trace.rotary or child
            rotary_tables.append(output)
        elif is_norm(child):  # the final norm; and a norm before the first layer (nanochat: the same module)
            first_in = seen["io"][0][1]
            for _, _, n_in, n_out in calls:
                if _same(n_in, last_out) and _same(n_out, head_in):
                    trace.final_norm = child
                elif _same(n_in, last_out) and not head_has_bias and (s := scale_between(n_out, head_in)) is not None:
                    trace.final_norm, head_input_scale = child, s  # head(s * x) = s * head(x) without a bias
                elif _same(n_out, first_in):
                    trace.embed_norm, embed_norm_in = child, n_in
        elif isinstance(child, torch.nn.Embedding) and output.shape == seen["embed"].shape:
            offsets = [k for k in range(4) if torch.equal(child.weight[k : k + output.shape[1]], output[0])]
            if not offsets:
                return f"position embedding {name} is no slice of its table"
            trace.positions, trace.position_offset, pos_out = child.weight, offsets[0], output
    if trace.final_norm is None:
        return "no final norm between the last layer and the head"
    if any(not _same_tables(t, rotary_tables[0]) for t in rotary_tables[1:]):
        return f"{len(rotary_tables)} rotary modules with tables of their own"
    first_in = seen["io"][0][1] if trace.embed_norm is None else embed_norm_in
    embed_scale = scale_between(seen["embed"], first_in if pos_out is None else first_in - pos_out)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    logit_scale = scale_between(head_out if softcap is None else torch.tanh(head_out / softcap) * softcap, logits)
    if embed_scale is None or logit_scale is None:
        return "the first layer's input or the logits are no multiple of the embedding or the head"
    trace.embed_scale, trace.logit_scale = embed_scale, logit_scale * head_input_scale
    return trace
