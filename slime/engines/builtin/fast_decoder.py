"""A lean forward pass for pre-norm decoders over a slot KV cache (the built-in engine's fast path).

Why: at small batch the built-in engine spent most of each decode step in Hugging Face's
per-module Python (about 60 module calls per token for the tiny MoE) and in copying the whole KV
cache (``DynamicCache`` grows by concatenation). This module runs the same maths with plain torch
ops on the model's own parameter tensors (no copies: an in-place weight update is seen at once)
and keeps keys/values in preallocated per-layer tensors:

    keys[layer]: [row capacity, kv heads, length capacity, head dim]

Row ``r`` of the batch holds its tokens at positions ``0 .. lens[r]-1`` (no left padding, so a
token's position in the cache is its RoPE position). A decode step writes one key/value per row
at ``lens[r]`` and attends over ``[:rows, :, :max(lens)+1]`` with a length mask, in segments of
rows that each stop at their own longest row (:func:`decode_segments`). Rows stay
packed at the front: when rows finish, rows from the tail move into the holes (copying only
those rows), so the caller must reorder its per-row state with the order ``select`` returns.

Supported (`slime.engines.builtin.decoder_layers.hand_written_misfit`): a token embedding (plus a
learned position table or not), a list of layers, a final norm and a head, found by their place in
one traced forward (`slime.engines.builtin.decoder_tree`: Llama's ``model.model`` tree and GPT-2's
``transformer.h`` read alike), layers of norm -> attention -> norm -> MLP, or Gemma's sandwich
(norms around the MLP too), or the MLP beside the attention (Cohere, GPT-NeoX). The attention may
have separate or fused q/k/v projections (Phi-3, GPT-NeoX; ``nn.Linear`` or GPT-2's ``Conv1D``),
biases, q/k norms per head (Qwen3) or over the whole projection (OLMoE), sliding windows on some or all
layers, sinks (gpt-oss), soft-capping (Gemma 2), RoPE on part of each head (GLM-4.5) or from
per-layer-type tables (Gemma 3), or be multi-head latent attention (DeepSeek-V2/V3). A norm that
computes a plain RMSNorm is written out, any other runs as its module. The MLP is written out when
it is gated (separate or fused gate/up) or a top-k routed MoE (a ``gate`` or ``router`` module
returning ``(logits, weights, indices)`` + ``experts`` with fused ``gate_up_proj``/``down_proj``,
transposed or not, biases optional, activated by the experts' own ``_apply_gate``; optionally a
shared expert, sigmoid-gated as in Qwen2-MoE or not as in GLM-4.5 and DeepSeek); any other MLP
runs as the model's own module. That covers the 15 families of `benchmarks.families`
and most others transformers ships (docs/engines.md). `slime.engines.builtin.generic_decoder.fast_decoder_for` checks
the structure and then the numbers (logits against the model's own forward); other models take
the generic fast path there (this cache and layout, the model's own modules), or the Hugging
Face one. The router is called as a module, so forward hooks on it (the dashboard's
expert-load recorder) still fire.

Longer than 500 lines: the paged cache and the hand-written forward share the cache layout row by
row (decode, prefill, keep and restore rows, static steps); the layers, graphs and the generic path
are files of their own.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from slime.engines.builtin.decode_graphs import StaticDecode
from slime.engines.builtin.decoder_layers import (
    LayerTensors,
    apply_norm,
    expert_parts,
    read_norm,
    silu_gate,
    swiglu,
)
from slime.engines.builtin.decoder_tree import (
    DecoderTrace,
    attention_softmax,
    nearly_equal,
    scale_between,
    trace_decoder,
)
from slime.engines.builtin.rotary import ROTARY_MODES, pair_tables, rope, rope_pairs

log = logging.getLogger(__name__)

# A decode attention segment's fixed cost, in (row x cached position) units of its length-
# proportional cost: on CPU one more segment (mask slice, two matmuls, softmax per layer) costs
# about as much as attending 1,200 more positions (~60 us against ~0.05 us each).
SEGMENT_COST = 1200
SEGMENT_ROWS = 16


@functools.cache
def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here for this dtype: on CPU (torch >= 2.9) and for bf16 on
    CUDA compute capability 8.0+ (ran on an H200); any other CUDA dtype is tried once against one
    matmul per group, since its kernels depend on the torch version."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    if dtype == torch.bfloat16:
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return grouped_mm_agrees(device, dtype)


def grouped_mm_agrees(device: torch.device, dtype: torch.dtype) -> bool:
    """``torch._grouped_mm`` on small random groups (one empty) against one matmul per group."""
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(24, 32, generator=g).to(device, dtype)
        w = torch.randn(3, 32, 16, generator=g).to(device, dtype)
        offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)  # the middle group empty
        got = torch._grouped_mm(x, w, offs=offs).float()
        want = torch.cat([x[:8] @ w[0], x[8:24] @ w[2]]).float()
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())))
    except Exception:  # no kernel for this device or dtype
        return False


EXTENSION_SCORES = 1 << 24  # float32 scores one block of an extension's queries may hold (64 MiB)


def decode_segments(lens: np.ndarray) -> list[tuple[int, int, int]]:
    """Split the decode rows into contiguous segments ``(first row, end row, attended length)``,
    each attending only up to its own longest row.

    One padded attention over every row reads ``rows x longest`` cached positions. With APRIL the
    rows are very unequal (resumed partials of ~100 tokens beside fresh prompts of ~6), so most
    of that is padding. Blocks of ``SEGMENT_ROWS`` rows are merged with the previous segment
    while merging costs less than a segment's fixed cost.
    """
    segments: list[list[int]] = []
    for r0 in range(0, len(lens), SEGMENT_ROWS):
        r1 = min(r0 + SEGMENT_ROWS, len(lens))
        used = int(lens[r0:r1].max()) + 1
        if segments:
            s0, _, s_used = segments[-1]
            merged = (r1 - s0) * max(used, s_used)
            apart = (r0 - s0) * s_used + (r1 - r0) * used + SEGMENT_COST
            if merged <= apart:
                segments[-1][1:] = [r1, max(used, s_used)]
                continue
        segments.append([r0, r1, used])
    return [(r0, r1, used) for r0, r1, used in segments]


@dataclass
class StepLayout:
    """One forward's layout: flat tokens (decode rows first, then the new contexts' tokens)."""

    b: int  # decode rows fed (the first b flat tokens)
    ids: torch.Tensor  # [S] token ids
    pos: torch.Tensor  # [S] positions
    ctx_lens: list[int]  # per new row, its context length
    used: int  # decode: longest cached length + 1
    lens: torch.Tensor | None  # [b] decode rows' input positions
    padded: list[tuple[torch.Tensor, torch.Tensor, slice, int]] = field(default_factory=list)
    rows_idx: torch.Tensor | None = None
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    last: torch.Tensor | None = None  # [rows fed] flat index of each row's last token
    # Rows grown after their cached tokens (`FastDecoder.extend`): (row, flat start, tokens, cached length).
    extends: list[tuple[int, int, int, int]] = field(default_factory=list)
    masks: dict = field(default_factory=dict)  # (kind, window, dtype) -> additive mask, built once per step


def _query_scale(q: torch.Tensor, q_model: torch.Tensor) -> float:
    """s with q_model == s * q (1 where there is none, or it is 1 within rounding)."""
    s = scale_between(q, q_model) if q.shape == q_model.shape else None
    return 1.0 if s is None or abs(s - 1.0) < 1e-4 else s


def _column_order(
    fused: torch.Tensor, q_model: torch.Tensor, k_model: torch.Tensor, v_model: torch.Tensor
) -> torch.Tensor | None:
    """The fused projection's columns in [q; k; v] order, or None. Each head's query, key or value is
    a run of the projection's outputs (in any order of the heads: CodeGen's [q, v, k] per quarter):
    the run whose outputs equal the model's at position 0 (where RoPE turns nothing), or at every
    position for the values. Whole heads are matched, never single outputs, which a bf16 projection
    repeats. ``fused``: the projection's output [S, columns]; the model's q/k/v [S, heads, D] as
    `fit_attention` captures them."""
    d, dv, columns = q_model.shape[-1], v_model.shape[-1], fused.shape[-1]
    if k_model.shape[-1] != d or q_model[0].numel() + k_model[0].numel() + v_model[0].numel() != columns:
        return None
    step = math.gcd(d, dv)
    starts = []
    for t, at_every_position in ((q_model, False), (k_model, False), (v_model, True)):
        width = t.shape[-1]
        runs = fused.unfold(-1, width, step).to(t.dtype)  # [S, starts, width]
        for head in range(t.shape[1]):
            want = t[:, head] if at_every_position else t[:1, head]  # [S or 1, width]
            gaps = (runs[: want.shape[0]] - want.unsqueeze(1)).abs().amax(dim=(0, 2))
            start = int(gaps.argmin()) * step
            if not nearly_equal(fused[: want.shape[0], start : start + width].to(t.dtype), want):
                return None
            starts.append((start, width))
    order = torch.cat([torch.arange(start, start + width) for start, width in starts]).to(fused.device)
    return order if len(set(order.tolist())) == columns else None  # every output used once


def _largest_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) if got.shape == want.shape else float("inf")


class FastDecoder:
    """Batched prefill/decode over a slot KV cache; rows are appended by ``prefill`` and removed
    by ``select``. Call under ``torch.inference_mode()``."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_rows: int,
        max_len: int,
        rope_half_split: bool = False,
        trace: DecoderTrace | None = None,
    ):
        """``rope_half_split``: the rotary tables cover half a head and rotate the two halves of
        every head (gpt-oss), rather than only the first half of it (a partial rotary, GLM-4.5);
        the two read alike from the tables, so `fast_decoder_for` lets the logit check pick.
        ``trace``: the model's `trace_decoder`, where the caller has taken it already."""
        config = model.config
        self.rope_half_split = rope_half_split
        self.model = model
        trace = trace_decoder(model) if trace is None else trace  # ``trace``: the model's, already taken
        if isinstance(trace, str):
            raise ValueError(trace)
        self.embed = trace.embed.weight
        self.embed_scale = getattr(trace.embed, "embed_scale", None)  # Gemma: sqrt(hidden)
        # A learned absolute position table (GPT-2) and the row of position 0 in it (OPT: 2).
        self.positions, self.position_offset = trace.positions, trace.position_offset
        # Scales the model applies between the embedding and the first layer and on the logits
        # (Granite's embedding_multiplier and logits_scaling), read off a traced forward.
        self.embed_multiplier, self.logit_scale = trace.embed_scale, trace.logit_scale
        self.final_norm = read_norm(trace.final_norm)
        self.embed_norm = None if trace.embed_norm is None else read_norm(trace.embed_norm)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.rotary = trace.rotary  # None: no RoPE (GPT-2's learned positions)
        # Rotary tables per attention type (Gemma 3: another base for local layers), else one.
        self.rotary_by_type = (
            self.rotary is not None and "layer_type" in inspect.signature(self.rotary.forward).parameters
        )
        self.rotary_sin_first = self._sin_first()  # GPT-J's module gives (sin, cos)
        self.lm_head, self.lm_head_bias = trace.head.weight, trace.head.bias
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.attention_modules = [getattr(layer, flow.attn) for layer, flow in zip(trace.layer_modules, trace.layers)]
        self.layers = [
            LayerTensors(layer, flow, config, i, self.num_heads, self.num_kv_heads, self.head_dim)
            for i, (layer, flow) in enumerate(zip(trace.layer_modules, trace.layers))
        ]
        self.max_rows, self.max_len = int(max_rows), int(max_len)
        self.device, self.dtype = self.embed.device, self.embed.dtype
        # Tokens sorted by expert, one grouped matmul for all experts (CPU kernel since torch 2.9;
        # on CUDA it needs compute capability 8.0+); otherwise one matmul per expert.
        self.grouped_mm = grouped_mm_works(self.device, self.dtype)
        self.rotary_types = sorted({L.layer_type for L in self.layers}) if self.rotary_by_type else [None]
        self._init_cache([L.kv_shape for L in self.layers])
        self.routing_recorder = None  # routing replay: set by the engine (engines/routing.py)
        self.step_routing = None  # [rows, layers * top_k] uint8 after each forward, when recording
        self.static_decode: StaticDecode | None = None  # set by use_static_decode
        self.any_pairs = any(L.rotary == "pairs" for L in self.layers)  # DeepSeek's latent attention; fit_attention
        self.rotary_table_layout = "halves"  # how the model's table lists the angles (`pair_tables`)

    @torch.inference_mode()
    def fit_attention(self, captured: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """Each layer's attention as the model computes it: the rotary mode (`ROTARY_MODES`), the
        q/k norms before or after the rotation and, for per-head norms under other names, which is
        the queries' and which the keys'; the reading whose queries and keys come closest to those
        the model's own attention hands its attention function. Then the scale on the values
        (MiMo-V2's ``attention_value_scale``). ``captured``: layer -> (the attention's input [S, H],
        queries [S, heads, D], keys [S, kv heads, D], values [S, kv heads, Dv]) at positions 0..S-1.
        Latent attention: RoPE on interleaved pairs (DeepSeek) or halves (MiniCPM3), whichever
        matches (`_fit_latent_rotary`); layers not captured keep halves; the logit check judges
        the result."""
        if not captured:
            return
        first = next(iter(captured.values()))[0]
        mode_signs = self.rotary is not None
        if self.rotary is None:
            tables, modes = {None: (None, None)}, ("none",)
        else:
            tables = self._rotary_tables(first, torch.arange(first.shape[0], device=self.device))
            cos = next(iter(tables.values()))[0][-1]  # the last position's angles
            half = cos.shape[-1] // 2
            self.rotary_table_layout = (
                "halves"
                if torch.equal(cos[..., :half], cos[..., half:])
                else "pairs"
                if torch.equal(cos[..., 0::2], cos[..., 1::2])
                else "once"
            )
            modes = ROTARY_MODES
        for i, L in enumerate(self.layers):
            if i not in captured:
                continue
            h, q_model, k_model, v_model = captured[i]
            h = h.to(self.dtype)
            table = tables[L.layer_type if self.rotary_by_type else None]
            if L.mla is not None:
                self._fit_latent_rotary(L, h, table, q_model, k_model)
                continue
            # Norms under other names may be the queries' or the keys' (or neither: None).
            q_norms = [None, *L.loose_norms] if L.loose_norms else [L.q_norm]
            k_norms = [None, *L.loose_norms] if L.loose_norms else [L.k_norm]
            has_norms = L.loose_norms or L.q_norm is not None or L.k_norm is not None
            best: tuple = (float("inf"),)
            for order in self._qkv_readings(L, h, q_model, k_model, v_model):
                if order is not None:
                    (L.wq, L.bq), (L.wk, L.bk), (L.wv, L.bv) = order
                scopes = (False, True) if L.qk_norm_scope_unknown else [None]
                for mode, per_head, sign in itertools.product(modes, scopes, (1, -1) if mode_signs else (1,)):
                    cos_sin = pair_tables(*table, self.rotary_table_layout) if mode == "pairs" else table
                    L.rotary_sign = sign  # -1: the model turns the other way (nanochat's rotate_half)
                    if per_head is not None:
                        L.qk_norm_per_head = per_head
                    for after in (False, True) if has_norms else (False,):
                        L.rotary, L.qk_norm_after_rotary = mode, after
                        q_errors, k_errors = [], []  # per candidate: queries depend on q_norm only, keys on k_norm
                        q_scales = []  # queries the model scales before its attention (OPT): a multiple of ours
                        for q_norm, k_norm in zip(q_norms, k_norms):
                            L.q_norm, L.k_norm = q_norm, k_norm
                            q, k, _ = self._qkv(L, h, *cos_sin)
                            q_scales.append(_query_scale(q, q_model))
                            q_errors.append(_largest_difference(q * q_scales[-1], q_model))
                            k_errors.append(_largest_difference(k, k_model))
                        q_best, k_best = int(np.argmin(q_errors)), int(np.argmin(k_errors))
                        error = max(q_errors[q_best], k_errors[k_best])
                        if error < best[0]:  # ties: the first (halves, norms before RoPE)
                            chosen = (q_norms[q_best], k_norms[k_best], q_scales[q_best], L.qk_norm_per_head, sign)
                            best = (error, order, mode, after, *chosen)
            (
                _,
                order,
                L.rotary,
                L.qk_norm_after_rotary,
                L.q_norm,
                L.k_norm,
                q_scale,
                L.qk_norm_per_head,
                L.rotary_sign,
            ) = best
            L.scaling = L.attention_scaling * q_scale  # the same scores: (s q) . k * a = q . k * (s a)
            if order is not None:
                (L.wq, L.bq), (L.wk, L.bk), (L.wv, L.bv) = order
            _, _, v = self._qkv(L, h, *table)
            if v.shape == v_model.shape:
                L.v_scale = scale_between(v, v_model) or 1.0
        self.any_pairs = any(L.rotary == "pairs" for L in self.layers)

    def _fit_latent_rotary(self, L: LayerTensors, h: torch.Tensor, table: tuple, q_model, k_model) -> None:
        """Latent attention's RoPE on interleaved pairs (DeepSeek) or halves (MiniCPM3): the config's
        reading, unless only the other one gives the model's queries and keys. (Where neither
        does, say a query scale the comparison does not model, the config's stays and the logit
        check judges.)"""
        if table[0] is None:
            return

        def matches(interleaved: bool) -> bool:
            L.mla.interleaved = interleaved
            q, k, _ = L.mla.qkv(h, *(pair_tables(*table, self.rotary_table_layout) if interleaved else table))
            return nearly_equal(q, q_model) and nearly_equal(k, k_model)

        configured = L.mla.interleaved
        switch = not matches(configured) and matches(not configured)
        L.mla.interleaved = not configured if switch else configured
        L.rotary = "pairs" if L.mla.interleaved else "halves"

    def _qkv_readings(
        self, L: LayerTensors, h: torch.Tensor, q_model: torch.Tensor, k_model: torch.Tensor, v_model: torch.Tensor
    ) -> list:
        """How a layer's projections may give its queries, keys and values, values checked against
        the model's (a multiple of them: MiMo-V2 scales its values). A fused projection: its layout
        is set to the one whose values match, [q; k; v] or per kv head [q..., k, v] (GPT-NeoX), or
        else any order of its columns that gives the model's q, k and v (CodeGen: [q, v, k] per
        quarter), and [None] returned. Three: the orders ((q), (k), (v)) to try, the values'
        projection the one that matches, queries and keys both ways round where their shapes allow."""
        if L.fused is not None:
            for layout in ("contiguous", "per_head"):
                L.fused = layout
                try:
                    v = self._qkv(L, h, None, None, values_only=True)
                except RuntimeError:  # the projection's size does not split this way
                    continue
                if v.shape == v_model.shape and scale_between(v, v_model) is not None:
                    break
            else:
                L.qkv_columns = _column_order(F.linear(h, L.w_qkv, L.b_qkv), q_model, k_model, v_model)
                L.fused = "contiguous" if L.qkv_columns is None else "columns"  # none: the logit check refuses
            return [None]
        parts = L.separate
        for j, (w, b) in enumerate(parts):
            v = F.linear(h, w, b)
            if v.numel() == v_model.numel() and scale_between(v.reshape(v_model.shape), v_model) is not None:
                q, k = (p for i, p in enumerate(parts) if i != j)
                return [(q, k, parts[j])] + ([(k, q, parts[j])] if q[0].shape == k[0].shape else [])
        return [tuple(parts)]

    @contextlib.contextmanager
    def loose_norms_told_apart(self) -> Iterator[None]:
        """While inside, the first per-head norm under another name in every layer is doubled (exact
        in any float format, undone after). A random-init model's norms are all ones, so the
        queries' and the keys' norm would be told apart by nothing; `fit_attention` runs in here, on
        queries and keys captured in here. The layers hold views, so they see the change too."""
        weights = [n[0] if isinstance(n, tuple) else n.weight for L in self.layers for n in L.loose_norms[:1]]
        with torch.no_grad():
            for w in weights:
                w.mul_(2)
        try:
            yield
        finally:
            with torch.no_grad():
                for w in weights:
                    w.div_(2)

    def use_static_decode(self, capture: bool) -> None:
        """Decode-only steps run at static shapes (`slime.engines.builtin.decode_graphs`), captured as CUDA
        graphs when ``capture`` and on CUDA; prefill steps stay eager."""
        self.static_decode = StaticDecode(self, capture)

    def _init_cache(self, kv_shapes: list[tuple[int, int, int]]) -> None:
        """``kv_shapes``: per layer (kv heads, key head dim, value head dim)."""
        self.kv_shapes = kv_shapes
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.cache_generation = 0  # counts cache allocations (static decode shapes point into one)
        self.lens = np.zeros(0, dtype=np.int64)  # host copy of each row's cached length
        self.rows = 0
        self.shared_prefill_tokens = 0  # context tokens not fed again: a repeat of one in the same prefill

    # ---------------------------------------------------------------- cache capacity

    def _capacity(self) -> tuple[int, int]:
        return (self.keys[0].shape[0], self.keys[0].shape[2]) if self.keys else (0, 0)

    def _reserve(self, rows: int, length: int) -> None:
        """Grow the cache (doubling) to hold ``rows`` rows of ``length`` tokens."""
        cap_rows, cap_len = self._capacity()
        if rows <= cap_rows and length <= cap_len:
            return
        new_rows = cap_rows if rows <= cap_rows else max(rows, min(max(2 * cap_rows, 8), self.max_rows))
        new_len = cap_len if length <= cap_len else max(length, min(max(2 * cap_len, 64), self.max_len))
        used = int(self.lens.max()) if self.rows else 0
        self.cache_generation += 1
        for store, dim in ((self.keys, 1), (self.values, 2)):
            for i, shape in enumerate(self.kv_shapes):
                fresh = torch.zeros((new_rows, shape[0], new_len, shape[dim]), dtype=self.dtype, device=self.device)
                if store and self.rows:
                    fresh[: self.rows, :, :used] = store[i][: self.rows, :, :used]
                if len(store) == len(self.kv_shapes):
                    store[i] = fresh
                else:
                    store.append(fresh)

    # ---------------------------------------------------------------- rows

    def select(self, keep: list[int]) -> list[int]:
        """Keep rows ``keep`` (ascending indices); return the new row order as old indices.

        Kept rows already inside the new range stay where they are; each hole is filled by a
        kept row from the tail, so only moved rows are copied.
        """
        n = len(keep)
        keep_set = set(keep)
        order = list(range(n))
        holes = [i for i in range(n) if i not in keep_set]
        movers = [i for i in keep if i >= n]
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            used = int(self.lens[movers].max())
            for store in (self.keys, self.values):
                for t in store:
                    t[dst, :, :used] = t[src, :, :used]
            for h, m in zip(holes, movers):
                order[h] = m
        self.lens = self.lens[order]
        self.rows = n
        return order

    def take_rows(self, rows: list[int]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Copies of rows' cached keys/values (per layer ``[kv heads, lens[r], head dim]``), for
        :meth:`put_rows` to bring back later; the rows themselves stay until ``select``."""
        out = []
        for r in rows:
            used = int(self.lens[r])
            out.append(([k[r, :, :used].clone() for k in self.keys], [v[r, :, :used].clone() for v in self.values]))
        return out

    def put_rows(self, saved: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
        """Append rows whose keys/values were taken by :meth:`take_rows` (no forward pass)."""
        lengths = [int(keys[0].shape[1]) for keys, _ in saved]
        start = self.rows
        self._reserve(start + len(saved), max(lengths) + 1)
        for j, ((keys, values), used) in enumerate(zip(saved, lengths)):
            for store, parts in ((self.keys, keys), (self.values, values)):
                for t, part in zip(store, parts):
                    t[start + j, :, :used] = part
        self.lens = np.concatenate([self.lens, np.array(lengths, dtype=np.int64)])
        self.rows = start + len(saved)

    # ---------------------------------------------------------------- forward

    def _mlp(self, L: LayerTensors, x: torch.Tensor) -> torch.Tensor:
        """x: [S, H] -> [S, H]."""
        if L.plain is not None:
            w1, b1, act, w2, b2 = L.plain
            return F.linear(act(F.linear(x, w1, b1)), w2, b2)
        if L.mlp_module is not None:
            y = L.mlp_module(x[None])
            return (y[0] if isinstance(y, tuple) else y).reshape(x.shape)
        if L.router is None:
            return swiglu(x, L.dense)
        _, weights, experts = L.router(x)  # [S, k] each; a module call so its hooks fire
        k = experts.shape[1]
        sorted_experts, perm = torch.sort(experts.reshape(-1))
        token = perm // k
        xs = x[token]
        if self.grouped_mm:
            # Each expert's end offset, found on the device (bincount would wait on the host).
            ends = torch.arange(1, L.num_experts + 1, device=x.device, dtype=sorted_experts.dtype)
            offs = torch.searchsorted(sorted_experts, ends, right=False).to(torch.int32)
            h = torch._grouped_mm(xs, L.gate_up, offs=offs)
        else:  # one matmul per routed expert
            counts = torch.bincount(sorted_experts, minlength=L.num_experts)
            h = torch.cat([part @ L.gate_up[e] for e, part in expert_parts(xs, counts)])
        if L.gate_up_bias is not None:
            h = h + L.gate_up_bias[sorted_experts]
        h = L.apply_gate(h) if L.apply_gate is not None else silu_gate(h)
        if self.grouped_mm:
            y = torch._grouped_mm(h, L.down, offs=offs)
        else:
            y = torch.cat([part @ L.down[e] for e, part in expert_parts(h, counts)])
        if L.down_bias is not None:
            y = y + L.down_bias[sorted_experts]
        y = y * weights.reshape(-1)[perm, None].to(y.dtype)
        out = torch.zeros_like(x).index_add_(0, token, y)
        if L.shared is not None:  # a shared expert every token takes, optionally sigmoid-gated (Qwen2-MoE)
            shared = swiglu(x, L.shared)
            if L.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, *L.shared_gate)) * shared
            out = out + shared
        return out

    @torch.inference_mode()
    def rotary_dim(self) -> int:
        """How many dims per head the model's rotary tables cover (as the model gives them)."""
        if self.rotary is None:
            return 0
        pos = torch.zeros(1, dtype=torch.long, device=self.device)
        tables = self._rotary_tables(self.embed[:1], pos, half_split=False)
        return min(int(cos.shape[-1]) for cos, _ in tables.values())

    @torch.inference_mode()
    def _sin_first(self) -> bool:
        """Whether the rotary module gives (sin, cos): at position 0 the sines are 0, the cosines 1."""
        if self.rotary is None:
            return False
        extra = (
            ((getattr(self.model.config, "layer_types", None) or ["full_attention"])[0],) if self.rotary_by_type else ()
        )
        pos = torch.zeros(1, 1, dtype=torch.long, device=self.embed.device)
        table = self.rotary(self.embed[None, :1], pos, *extra)
        if not isinstance(table, tuple):
            return False
        return bool(torch.all(table[0] == 0)) and bool(torch.all(table[1] == 1))

    def _rotary_tables(
        self, x: torch.Tensor, pos: torch.Tensor, half_split: bool | None = None
    ) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type, cos and sin [S, 1, rotary dims] of positions ``pos`` [S]; ``half_split``
        (default: the decoder's) repeats them over both halves of a head."""
        if self.rotary is None:
            return {None: (None, None)}
        half_split = self.rope_half_split if half_split is None else half_split
        tables = {}
        for layer_type in self.rotary_types:
            extra = (layer_type,) if self.rotary_by_type else ()
            table = self.rotary(x[None], pos[None], *extra)
            if isinstance(table, torch.Tensor) and table.is_complex():  # e^(i angle) per pair (DeepSeek-V2)
                cos, sin = torch.cat((table.real, table.real), dim=-1), torch.cat((table.imag, table.imag), dim=-1)
                cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            else:
                cos, sin = table[::-1] if self.rotary_sin_first else table
            cos, sin = cos[0][:, None], sin[0][:, None]
            if half_split:
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            tables[layer_type] = (cos, sin)
        return tables

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(apply_norm(hidden, self.final_norm), self.lm_head, self.lm_head_bias)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def forward(
        self, last_tokens: torch.Tensor | None, positions: torch.Tensor | None, groups: list[list[list[int]]]
    ) -> torch.Tensor:
        """One forward pass over every token of this step, flattened into one sequence:

        - with ``last_tokens`` [rows], each existing row decodes: its token is fed at position
          ``lens[r]`` (the caller's ``positions`` are the same numbers), attending over its cache
          (a length mask hides other rows' longer caches);
        - every context of ``groups`` becomes a new row after the existing ones (in order) and is
          prefilled, each group right padded to its own widest context for causal attention;
          identical contexts are fed once and their rows share its keys, values and logits.

        Projections, norms and the MoE run once over the real tokens of both kinds. Returns the
        next-token logits of every row fed: [decoded rows + new rows, V].
        """
        if self.static_decode is not None and last_tokens is not None and not groups and self.static_decode.usable():
            if self.routing_recorder is not None:
                self.routing_recorder.start()
            logits = self.static_decode.run(last_tokens)
            if self.routing_recorder is not None:
                self.step_routing = self.routing_recorder.rows(torch.arange(self.rows, device=self.device))
            self.lens = self.lens + 1
            return logits
        step = self._plan(last_tokens, groups)
        if self.routing_recorder is not None:
            self.routing_recorder.start()
        logits = self._compute(step)
        # Routing replay: each row's experts at the position that gives its next token.
        self.step_routing = self.routing_recorder.rows(step.last) if self.routing_recorder is not None else None
        if step.b:
            self.lens = self.lens + 1
        self.lens = np.concatenate([self.lens, np.array(step.ctx_lens, dtype=np.int64)])
        self.rows += len(step.ctx_lens)
        return logits

    def _plan(self, last_tokens: torch.Tensor | None, groups: list[list[list[int]]]) -> StepLayout:
        """The flat tokens, positions and row layout of one forward (see `forward`); grows the cache."""
        dev = self.device
        b = self.rows if last_tokens is not None else 0
        contexts = [c for g in groups for c in g]
        n_new = len(contexts)
        ctx_lens = [len(c) for c in contexts]
        width = max(ctx_lens, default=0)
        used = int(self.lens.max()) + 1 if b else 0
        self._reserve(self.rows + n_new, max(used, width + 1))

        # Identical contexts (the n samples of a group share their prompt) are fed once: each new
        # row reads its keys/values and last logits from its context's first occurrence.
        starts: list[int] = []  # per new row: flat index of its context's first token
        first: list[bool] = []  # per new row: the first occurrence of its context
        seen: dict[tuple[int, ...], int] = {}
        fed: list[int] = []
        for c in contexts:
            start = seen.setdefault(tuple(c), b + len(fed))
            first.append(start == b + len(fed))
            if first[-1]:
                fed.extend(c)
            starts.append(start)
        self.shared_prefill_tokens += sum(n for n, f in zip(ctx_lens, first) if not f)

        lens = torch.from_numpy(self.lens).to(dev) if b else None  # decode rows' input positions
        flat_ids = [last_tokens.to(dev)] if b else []
        pos_parts = [lens] if b else []
        if contexts:
            flat_ids.append(torch.tensor(fed, dtype=torch.long, device=dev))
            pos_parts.append(torch.cat([torch.arange(n, device=dev) for n, f in zip(ctx_lens, first) if f]))
        step = StepLayout(
            b=b, ids=torch.cat(flat_ids), pos=torch.cat(pos_parts), ctx_lens=ctx_lens, used=used, lens=lens
        )
        # Each new group, right padded: padded slot -> flat index (pads repeat the group's first
        # token; causal attention keeps real tokens off the padding after them, and a row's padding
        # keys are overwritten by its own decode steps before they are read). A repeated context's
        # row computes attention too, but only first occurrences give the flat outputs.
        new_row = 0
        row = self.rows
        for g in groups:
            g_lens = [len(c) for c in g]
            w = max(g_lens)
            index = torch.full((len(g), w), starts[new_row], dtype=torch.long)
            real = torch.zeros(len(g), w, dtype=torch.bool)
            for j, n in enumerate(g_lens):
                start = starts[new_row + j]
                index[j, :n] = torch.arange(start, start + n)
                real[j, :n] = first[new_row + j]
            step.padded.append((index.to(dev), real.reshape(-1).to(dev), slice(row, row + len(g)), w))
            row += len(g)
            new_row += len(g)
        if b:
            step.rows_idx = torch.arange(b, device=dev)
            step.segments = decode_segments(self.lens)
        step.last = torch.tensor(list(range(b)) + [start + n - 1 for start, n in zip(starts, ctx_lens)], device=dev)
        return step

    def static_layout(self, ids: torch.Tensor, positions: torch.Tensor, length: int) -> StepLayout:
        """A decode step of every row of ``ids`` at ``positions``, attending over ``length`` cached
        positions in one segment (the static steps of `slime.engines.builtin.decode_graphs`)."""
        rows = torch.arange(len(ids), device=self.device)
        return StepLayout(
            b=len(ids),
            ids=ids,
            pos=positions,
            ctx_lens=[],
            used=length,
            lens=positions,
            rows_idx=rows,
            segments=[(0, len(ids), length)],
            last=rows,
        )

    def _attend(
        self,
        i: int,
        step: StepLayout,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scaling: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer ``i``'s attention for every flat token: q [S, heads, D], k [S, kv heads, D],
        v [S, kv heads, Dv] (after RoPE). Stores the keys and values in the cache and returns
        [S, heads * Dv]. ``window``: a query at p sees keys at (p - window, p]; ``softcap``:
        scores become softcap * tanh(scores / softcap); ``sinks`` [heads]: one more logit per head
        that takes probability mass and gives no value (attention sinks)."""
        keys, values = self.keys[i], self.values[i]
        heads, kv_heads = q.shape[1], k.shape[1]
        group = heads // kv_heads
        plain = softcap is None and sinks is None
        out = []
        b = step.b
        if b:
            keys[step.rows_idx, :, step.lens] = k[:b]
            values[step.rows_idx, :, step.lens] = v[:b]
            decode_bias = step.masks.get(("decode", window, q.dtype))
            if decode_bias is None:
                positions = torch.arange(step.used, device=self.device)[None, :]
                hidden = positions > step.lens[:, None]
                if window is not None:
                    hidden = hidden | (positions <= step.lens[:, None] - window)
                # Additive mask [b, 1, 1, used]: 0 on a row's own visible positions, -inf elsewhere.
                decode_bias = torch.zeros(b, 1, 1, step.used, dtype=q.dtype, device=self.device).masked_fill_(
                    hidden[:, None, None, :], float("-inf")
                )
                step.masks[("decode", window, q.dtype)] = decode_bias
            for r0, r1, seg_used in step.segments:
                n = r1 - r0
                seg_keys, seg_values = keys[r0:r1, :, :seg_used], values[r0:r1, :, :seg_used]
                seg_bias = decode_bias[r0:r1, :, :, :seg_used]
                # One query per row: two batched matmuls over [n, kv heads, group, .] (query head h
                # reads kv head h // group, as enable_gqa, nothing expanded). They beat SDPA's CPU
                # kernel, and on CUDA they build no plan per call for a length that grows every step
                # (cuDNN's SDPA does) and go into a CUDA graph. Scores and softmax in float32: bf16
                # scores (3 significant digits) moved the H200's logprobs by up to 0.1.
                qg = q[r0:r1].reshape(n, kv_heads, group, q.shape[-1])
                scores = torch.matmul(qg.float(), seg_keys.transpose(-1, -2).float()) * scaling
                probs = attention_softmax(
                    scores, seg_bias, softcap, None if sinks is None else sinks.view(kv_heads, group)
                )
                att = torch.matmul(probs.to(seg_values.dtype), seg_values)
                out.append(att.reshape(n, -1))
        for row, s0, n, cached in step.extends:
            out.append(
                self._attend_extension(
                    keys[row],
                    values[row],
                    q[s0 : s0 + n],
                    k[s0 : s0 + n],
                    v[s0 : s0 + n],
                    cached,
                    scaling,
                    window,
                    softcap,
                    sinks,
                )
            )
        for index, real, rows, w in step.padded:
            qp, kp, vp = (t[index].transpose(1, 2) for t in (q, k, v))  # [n, heads, w, D]
            keys[rows, :, :w] = kp
            values[rows, :, :w] = vp
            if plain and window is None:
                att = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True, scale=scaling)
            else:
                bias = step.masks.get(("prefill", w, window, q.dtype))
                if bias is None:
                    positions = torch.arange(w, device=self.device)
                    hidden = positions[None, :] > positions[:, None]
                    if window is not None:
                        hidden = hidden | (positions[None, :] <= positions[:, None] - window)
                    bias = torch.zeros(w, w, dtype=q.dtype, device=self.device).masked_fill_(hidden, float("-inf"))
                    step.masks[("prefill", w, window, q.dtype)] = bias
                n = qp.shape[0]
                qg = qp.reshape(n, kv_heads, group, w, qp.shape[-1])
                scores = torch.matmul(qg, kp[:, :, None].transpose(-1, -2)) * scaling  # [n, kv, group, w, w]
                probs = attention_softmax(
                    scores, bias, softcap, None if sinks is None else sinks.view(kv_heads, group, 1)
                )
                att = torch.matmul(probs, vp[:, :, None]).reshape(n, heads, w, -1)
            out.append(att.transpose(1, 2).reshape(-1, heads * v.shape[-1])[real])
        return torch.cat(out) if len(out) > 1 else out[0]

    def _attend_extension(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cached: int,
        scaling: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """One row's new tokens (q [n, heads, D], k/v [n, kv heads, D*]) at positions cached..cached+n-1,
        attending over the row's ``cached`` keys/values and causally over each other; stores their
        keys and values in the row's cache (keys [kv heads, len, D]) and returns [n, heads * Dv].
        Scores in float32 as in decode, over blocks of queries so a long extension stays in memory."""
        n, heads, kv_heads = q.shape[0], q.shape[1], k.shape[1]
        group = heads // kv_heads
        total = cached + n
        keys[:, cached:total] = k.transpose(0, 1)
        values[:, cached:total] = v.transpose(0, 1)
        plain = softcap is None and sinks is None
        # SDPA's fused kernels where nothing but a mask is asked for (scores never materialised: an
        # observation over a long context); else explicit float32 scores, like decode.
        block = max(1, EXTENSION_SCORES // (total if plain else heads * total))
        key_pos = torch.arange(total, device=self.device)[None, :]
        if plain:
            row_keys, row_values = keys[None, :, :total], values[None, :, :total]
        else:
            row_keys = keys[:, None, :total].transpose(-1, -2).float()  # [kv heads, 1, D, total]
            row_values = values[:, None, :total]
        out = []
        for b0 in range(0, n, block):
            b1 = min(n, b0 + block)
            query_pos = torch.arange(cached + b0, cached + b1, device=self.device)[:, None]
            hidden = key_pos > query_pos
            if window is not None:
                hidden = hidden | (key_pos <= query_pos - window)
            if plain:
                att = F.scaled_dot_product_attention(
                    q[None, b0:b1].transpose(1, 2),
                    row_keys,
                    row_values,
                    attn_mask=~hidden,
                    scale=scaling,
                    enable_gqa=True,
                )  # [1, heads, m, Dv]
                out.append(att[0].transpose(0, 1).reshape(b1 - b0, -1))
                continue
            bias = torch.zeros(hidden.shape, dtype=torch.float32, device=self.device).masked_fill_(
                hidden, float("-inf")
            )
            qg = q[b0:b1].reshape(b1 - b0, kv_heads, group, -1).permute(1, 2, 0, 3)  # [kv, group, m, D]
            scores = torch.matmul(qg.float(), row_keys) * scaling  # [kv, group, m, total]
            probs = attention_softmax(scores, bias, softcap, None if sinks is None else sinks.view(kv_heads, group, 1))
            att = torch.matmul(probs.to(row_values.dtype), row_values)  # [kv, group, m, Dv]
            out.append(att.permute(2, 0, 1, 3).reshape(b1 - b0, -1))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _qkv(
        self, L: LayerTensors, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, values_only=False
    ) -> tuple[torch.Tensor, ...]:
        """Queries [S, heads, D], keys and values [S, kv heads, D], with q/k norms and RoPE
        (``values_only``: the values alone)."""
        s_tokens, heads, d = h.shape[0], self.num_heads, self.head_dim
        if L.fused is None:
            q, k, v = F.linear(h, L.wq, L.bq), F.linear(h, L.wk, L.bk), F.linear(h, L.wv, L.bv)
        elif L.fused == "contiguous":  # [q; k; v]
            q, k, v = F.linear(h, L.w_qkv, L.b_qkv).split([heads * d, L.kv_heads * d, L.kv_heads * L.v_dim], dim=-1)
        elif L.fused == "columns":  # [q; k; v] gathered from the projection's columns (`_column_order`)
            y = F.linear(h, L.w_qkv, L.b_qkv).index_select(-1, L.qkv_columns)  # index_select: ~5x faster than y[:, i]
            q, k, v = y.split([heads * d, L.kv_heads * d, L.kv_heads * L.v_dim], dim=-1)
        else:  # per kv head: its queries, its key, its value (GPT-NeoX, Falcon's grouped layout)
            y = F.linear(h, L.w_qkv, L.b_qkv).view(s_tokens, L.kv_heads, -1, d)
            q, k, v = y[:, :, :-2].reshape(s_tokens, heads * d), y[:, :, -2], y[:, :, -1]
        v = v.reshape(s_tokens, L.kv_heads, L.v_dim)
        if L.v_scale != 1.0:
            v = v * L.v_scale
        if values_only:
            return v
        if L.q_norm is not None and not L.qk_norm_per_head:
            q = apply_norm(q, L.q_norm)
        if L.k_norm is not None and not L.qk_norm_per_head:
            k = apply_norm(k.reshape(s_tokens, -1), L.k_norm)
        q = q.reshape(s_tokens, heads, d)
        k = k.reshape(s_tokens, L.kv_heads, d)
        if L.qk_norm_per_head and not L.qk_norm_after_rotary:
            q, k = apply_norm(q, L.q_norm), apply_norm(k, L.k_norm)
        if L.rotary != "none":
            turn = rope_pairs if L.rotary == "pairs" else rope
            if L.rotary_sign < 0:
                sin = -sin
            q, k = turn(q, cos, sin), turn(k, cos, sin)
            if q.dtype != h.dtype:  # float32 tables (OLMo 2 rotates in float32, then casts back)
                q, k = q.to(h.dtype), k.to(h.dtype)
        if L.qk_norm_per_head and L.qk_norm_after_rotary:
            q, k = apply_norm(q, L.q_norm), apply_norm(k, L.k_norm)
        return q, k, v

    def _compute(self, step: StepLayout) -> torch.Tensor:
        """The hand-written layers: next-token logits of ``step.last``."""
        x = F.embedding(step.ids, self.embed)  # [S, H]
        if self.embed_scale is not None:  # a tensor (Gemma) or a float (BioGPT)
            x = x * (self.embed_scale.to(x.dtype) if isinstance(self.embed_scale, torch.Tensor) else self.embed_scale)
        if self.embed_multiplier != 1.0:
            x = x * self.embed_multiplier
        if self.positions is not None:
            x = x + F.embedding(step.pos + self.position_offset, self.positions)
        if self.embed_norm is not None:
            x = apply_norm(x, self.embed_norm)
        tables = self._rotary_tables(x, step.pos)
        pairs = (
            {kind: pair_tables(*t, self.rotary_table_layout) for kind, t in tables.items()} if self.any_pairs else {}
        )
        for i, L in enumerate(self.layers):
            cos, sin = (pairs if L.rotary == "pairs" else tables)[L.layer_type if self.rotary_by_type else None]
            layer_in, h = x, apply_norm(x, L.attn_in)
            q, k, v = L.mla.qkv(h, cos, sin) if L.mla is not None else self._qkv(L, h, cos, sin)
            att = self._attend(i, step, q, k, v, L.scaling, L.window, L.softcap, L.sinks)
            if L.out_norm is not None:
                att = apply_norm(att, L.out_norm)
            if L.out_gate is not None:
                att = self._gated(att, h, *L.out_gate)
            att = F.linear(att, L.wo, L.bo)
            x = self._residual_add(x, apply_norm(att, L.attn_out), L.flow.residual_scale)
            if L.flow.parallel:  # beside the attention: its input, or the layer's through a norm of its own
                mlp_in = h if L.mlp_in is None else apply_norm(layer_in, L.mlp_in)
            else:
                mlp_in = apply_norm(x, L.mlp_in)
            x = self._residual_add(x, apply_norm(self._mlp(L, mlp_in), L.mlp_out), L.flow.residual_scale)
        return self._logits(x[step.last])

    @staticmethod
    def _gated(att: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act) -> torch.Tensor:
        """The attention's output [S, heads * Dv] scaled by act(gate projection of its input), one
        gate per value or per head."""
        gate = act(F.linear(h, w, b).float()).to(att.dtype)
        if gate.shape[-1] == att.shape[-1]:
            return att * gate
        return (att.view(att.shape[0], gate.shape[-1], -1) * gate[..., None]).view(att.shape)

    @staticmethod
    def _residual_add(x: torch.Tensor, branch: torch.Tensor, scale: float) -> torch.Tensor:
        return x + branch if scale == 1.0 else x + branch * scale

    def prefill(self, contexts: list[list[int]]) -> torch.Tensor:
        """Append one row per context (existing rows are not fed); next-token logits [n, V]."""
        return self.forward(None, None, [contexts])

    def extend(self, rows: list[int], suffixes: list[list[int]]) -> None:
        """Feed each of ``rows`` its ``suffixes`` tokens after the ones it has cached (positions
        lens[r] on), storing their keys and values: a kept cache grown by new context (the next
        turn of an episode: the observation) without the prefix being prefilled again. Other rows
        are not fed; nothing is sampled."""
        todo = [(r, list(s)) for r, s in zip(rows, suffixes) if s]
        if not todo:
            return
        dev = self.device
        self._reserve(self.rows, max(int(self.lens[r]) + len(s) for r, s in todo) + 1)
        extends, ids, pos = [], [], []
        for r, s in todo:
            cached = int(self.lens[r])
            extends.append((r, len(ids), len(s), cached))
            ids.extend(s)
            pos.append(torch.arange(cached, cached + len(s), device=dev))
        step = StepLayout(
            b=0,
            ids=torch.tensor(ids, dtype=torch.long, device=dev),
            pos=torch.cat(pos),
            ctx_lens=[],
            used=0,
            lens=None,
            last=torch.tensor([s0 + n - 1 for _, s0, n, _ in extends], device=dev),
            extends=extends,
        )
        self._compute(step)
        for r, _, n, _ in extends:
            self.lens[r] += n

    def decode(self, last_tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row, fed at position lens[r] (the caller's ``positions`` are the same
        numbers); return next-token logits [rows, V]."""
        return self.forward(last_tokens, positions, [])

    def kv_len(self) -> int:
        return int(self.lens.max()) if self.rows else 0
