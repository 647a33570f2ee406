"""The built-in engine's fast path for any decoder-only model transformers can build.

The model's own modules run everything (embeddings, norms, RoPE, MLP or MoE, the head); the
engine supplies only the attention, through the attention-function hook transformers exposes
(`AttentionInterface`), over the same preallocated slot KV cache and flat token layout as the
hand-written path (`slime.engines.builtin.fast_decoder`): decode rows and prefill contexts in one forward,
rows packed at the front, identical prompts fed once. Sliding windows, logit soft-capping and
attention sinks are applied as the model's attention module asks for them (`sliding_window`,
`softcap`, `s_aux`); keys and values may differ in head size (MLA). A model whose layers do not
all go through the hook (a linear-attention or state-space layer) is refused at start, as is any
model whose logits disagree with its own forward: it keeps the Hugging Face path, the reason logged.

`fast_decoder_for` picks the path: the hand-written layers where they fit (measurably faster,
docs/benchmarks.md "Model zoo"), else this one, else None.
"""

from __future__ import annotations

import logging
import threading

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from slime.engines.builtin.decoder_layers import hand_written_misfit
from slime.engines.builtin.decoder_tree import DecoderTrace, attention_implementation, trace_decoder
from slime.engines.builtin.fast_decoder import FastDecoder, StepLayout
from slime.engines.builtin.start_check import agrees_with_model

log = logging.getLogger(__name__)

ATTENTION = "slime_cached"
_PROBE = "slime_probe"
_active = threading.local()  # .run: (decoder, step) while a GenericDecoder forward runs in this thread


def _cached_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention call: query [1, heads, S, D], key/value [1, kv heads, S, D*];
    returns [1, S, heads, Dv]. The mask is ignored: the cache's layout defines it."""
    decoder, step = _active.run
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [S, heads, D]
    window = kwargs.get("sliding_window")
    out = decoder._attend(
        decoder.layer_slot[module.layer_idx],
        step,
        q,
        k,
        v,
        float(scaling if scaling is not None else q.shape[-1] ** -0.5),
        int(window) if window else None,
        kwargs.get("softcap"),
        kwargs.get("s_aux"),
    )
    return out.view(1, q.shape[0], q.shape[1], -1), None


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _active.shapes[module.layer_idx] = (int(key.shape[1]), int(key.shape[-1]), int(value.shape[-1]))
    _active.qkv[module.layer_idx] = tuple(t[0].transpose(0, 1) for t in (query, key, value))
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    return out, None


def _no_mask(*args, **kwargs) -> None:
    return None  # the cache's layout is the mask


AttentionInterface.register(ATTENTION, _cached_attention)
AttentionInterface.register(_PROBE, _probe_attention)
AttentionMaskInterface.register(ATTENTION, _no_mask)
AttentionMaskInterface.register(_PROBE, _no_mask)


def _layer_count(model: torch.nn.Module) -> int:
    config = model.config
    count = getattr(config, "num_hidden_layers", None)
    if count is None and hasattr(config, "get_text_config"):
        count = getattr(config.get_text_config(), "num_hidden_layers", None)
    return int(count or 0)


@torch.inference_mode()
def probe_kv_shapes(model: torch.nn.Module) -> list[tuple[int, int, int]] | str:
    """Per layer (kv heads, key dim, value dim), from one token through the model with a recording
    attention; or why the model cannot take this path."""
    _active.shapes, _active.qkv = {}, {}
    device = next(model.parameters()).device
    try:
        with attention_implementation(model, _PROBE):
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
        shapes = dict(_active.shapes)
    finally:
        _active.shapes, _active.qkv = {}, {}
    count = _layer_count(model)
    if not shapes or sorted(shapes) != list(range(count)):
        missing = sorted(set(range(count)) - set(shapes))
        return f"layers {missing[:8]} do not call the attention interface (linear attention or state-space layers)"
    return [shapes[i] for i in range(count)]


@torch.inference_mode()
def attention_inputs(
    model: torch.nn.Module, attentions: list[torch.nn.Module], length: int = 6
) -> dict[int, tuple[torch.Tensor, ...]]:
    """Per layer, what its attention module is given and what it hands its attention function, for
    ``length`` tokens at positions 0..length-1: (input [S, H], queries [S, heads, D], keys [S, kv
    heads, D], values [S, kv heads, Dv]) after the model's own q/k norms, rotation and value scale.
    ``attentions``: each layer's attention module (`FastDecoder.attention_modules`).
    The attention's output is zeros here: each layer's input is a valid input to it, not the model's
    true one."""
    inputs: dict[int, torch.Tensor] = {}

    def keep_input(i: int):
        def hook(module, args, kwargs):
            inputs[i] = (args[0] if args else kwargs["hidden_states"])[0]

        return hook

    handles = [attn.register_forward_pre_hook(keep_input(i), with_kwargs=True) for i, attn in enumerate(attentions)]
    _active.shapes, _active.qkv = {}, {}
    device = next(model.parameters()).device
    try:
        with attention_implementation(model, _PROBE):
            model(input_ids=torch.arange(1, length + 1, device=device)[None], use_cache=False)
        qkv = dict(_active.qkv)
    finally:
        _active.shapes, _active.qkv = {}, {}
        for handle in handles:
            handle.remove()
    return {i: (inputs[i], *qkv[i]) for i in qkv if i in inputs}


class GenericDecoder(FastDecoder):
    """`FastDecoder`'s cache and row bookkeeping with the model's own modules doing the layers."""

    def __init__(self, model: torch.nn.Module, max_rows: int, max_len: int, kv_shapes: list[tuple[int, int, int]]):
        self.model = model
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.max_rows, self.max_len = int(max_rows), int(max_len)
        self.layer_slot = {i: i for i in range(len(kv_shapes))}
        self._logits_to_keep = True
        self._init_cache(kv_shapes)
        self.routing_recorder = None  # routing replay (see FastDecoder)
        self.step_routing = None
        self.static_decode = None  # static shapes and CUDA graphs: the hand-written layers only

    def _compute(self, step: StepLayout) -> torch.Tensor:
        _active.run = (self, step)
        try:
            with attention_implementation(self.model, ATTENTION):
                kwargs = {"input_ids": step.ids[None], "position_ids": step.pos[None], "use_cache": False}
                if self._logits_to_keep:
                    try:
                        return self.model(**kwargs, logits_to_keep=step.last).logits[0]
                    except TypeError:  # a forward without logits_to_keep: full logits, then pick
                        self._logits_to_keep = False
                return self.model(**kwargs).logits[0, step.last]
        finally:
            _active.run = None


def _checked_hand_written(
    model: torch.nn.Module, max_rows: int, max_len: int, rope_half_split: bool, trace: DecoderTrace | None = None
) -> tuple[FastDecoder | None, str | None]:
    """The hand-written layers over ``model`` and why their logits disagree with it (None: they agree)."""
    try:
        fast = FastDecoder(model, max_rows, max_len, rope_half_split=rope_half_split, trace=trace)
        with fast.loose_norms_told_apart():  # then each layer's rotation, norms and scales off the model
            fast.fit_attention(attention_inputs(model, fast.attention_modules))
    except Exception as exc:  # an unexpected module layout
        return None, f"{type(exc).__name__}: {exc}"
    try:
        return fast, agrees_with_model(model, fast)
    except Exception as exc:
        return fast, f"{type(exc).__name__}: {exc}"


def fast_decoder_for(
    model: torch.nn.Module, max_rows: int, max_len: int, hand_written: bool = True
) -> FastDecoder | None:
    """A checked fast path for ``model``: the hand-written layers where they fit (unless not
    ``hand_written``), else the model's own modules over the cached attention; None (the reasons
    logged) when neither agrees with the model's forward."""
    reasons = []
    trace = trace_decoder(model) if hand_written else "not asked for"  # one trace serves every check below
    reason = trace if isinstance(trace, str) else hand_written_misfit(model, trace)
    if reason is None:
        fast, reason = _checked_hand_written(model, max_rows, max_len, rope_half_split=False, trace=trace)
        if reason is not None and fast is not None and fast.rotary_dim() * 2 == fast.head_dim:
            # A rotary table of half a head reads two ways (FastDecoder): try the other one.
            fast, reason = _checked_hand_written(model, max_rows, max_len, rope_half_split=True, trace=trace)
        if reason is None:
            log.info("built-in engine: hand-written fast path (%s)", model.config.model_type)
            return fast
    reasons.append(f"hand-written path: {reason}")
    try:
        shapes = probe_kv_shapes(model)
        if isinstance(shapes, str):
            reason = shapes
        else:
            generic = GenericDecoder(model, max_rows, max_len, shapes)
            reason = agrees_with_model(model, generic)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    if reason is None:
        log.info("built-in engine: fast path over the model's own modules (%s)", model.config.model_type)
        return generic
    reasons.append(f"cached-attention path: {reason}")
    log.warning("built-in engine: Hugging Face forward path (%s)", "; ".join(reasons))
    return None
