"""Padding-free forwards for the learner: a micro-batch's rows laid end to end.

A padded micro-batch [n, L] computes every layer on n * L tokens, L the longest row; on a
long-tailed batch most of them are padding. Packed, the rows' real tokens form one sequence
[1, S] (S = the sum of their lengths) with position ids restarting at 0 in each row, and the
model's own modules (embeddings, norms, RoPE, MLP or MoE) run on S tokens only. Attention must
stay inside each row: the model's attention calls go through `packed_attention` (registered with
transformers' `AttentionInterface`), which attends within the boundaries `cu_seq_lens_q` (the
FlashAttention varlen layout; on a GPU, `flash_attention_2` reads the same arguments). Logits are
computed only where they predict a response token (`logits_to_keep`), so the output head never
runs on prompt tokens.

Sliding windows, logit soft-capping and attention sinks are applied as the module asks for them
(`sliding_window`, `softcap`, `s_aux`). A model is packed only when `packing_misfit` finds its
packed logits equal to its own forward of each row alone, on rows longer than its sliding
window; otherwise the learner keeps padded micro-batches and logs why.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from slime.engines.builtin.fast_decoder import attention_softmax

PACKED = "slime_packed"


def _row_attention(q, k, v, scaling, dropout, window, softcap, sinks) -> torch.Tensor:
    """Causal attention of rows of one length: q [rows, heads, n, D], k/v [rows, kv heads, n, D*]
    -> [rows, heads, n, Dv]."""
    if window is None and softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scaling
    n = q.shape[2]
    pos = torch.arange(n, device=q.device)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:  # a query at p sees keys at (p - window, p]
        allowed &= pos[None, :] > pos[:, None] - window
    bias = torch.zeros(allowed.shape, dtype=scores.dtype, device=scores.device).masked_fill(~allowed, float("-inf"))
    # the engine's softmax with soft-capping and sinks ([heads] -> [heads, 1]: one per head and query)
    probs = attention_softmax(
        scores.float(), bias.float(), softcap, None if sinks is None else sinks.float().view(-1, 1)
    )
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return probs.to(v.dtype) @ v


def _runs(bounds: list[int]) -> list[tuple[int, int, int]]:
    """(start, rows, length) of each run of consecutive rows of one length (PackedRows packs the
    rows by length, so rows of one length make one attention call)."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if runs and runs[-1][2] == b - a:
            start, rows, length = runs[-1]
            runs[-1] = (start, rows + 1, length)
        else:
            runs.append((a, 1, b - a))
    return runs


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention call on a packed sequence: query [1, heads, S, D], key/value
    [1, kv heads, S, D*]; returns [1, S, heads, Dv]. The mask is ignored: rows end at cu_seq_lens_q."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        raise RuntimeError(f"{PACKED} attention needs cu_seq_lens_q: this forward was not packed by the learner")
    scaling = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    window = kwargs.get("sliding_window")
    window = int(window) if window else None
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")

    def rows_of(t: torch.Tensor, start: int, rows: int, length: int) -> torch.Tensor:
        # [1, heads, rows * length, D] -> [rows, heads, length, D]
        return t[0, :, start : start + rows * length].unflatten(1, (rows, length)).transpose(0, 1)

    # Every layer gets the same cu_seq_lens_q: its runs are read off the device once per forward,
    # not once per layer (a host sync each on a GPU).
    runs = getattr(bounds, "_slime_runs", None)
    if runs is None:
        runs = bounds._slime_runs = _runs(bounds.tolist())
    parts = []
    for start, rows, length in runs:
        q, k, v = (rows_of(t, start, rows, length) for t in (query, key, value))
        out = _row_attention(q, k, v, scaling, dropout, window, softcap, sinks)  # [rows, heads, length, Dv]
        parts.append(out.transpose(0, 1).flatten(1, 2))  # [heads, rows * length, Dv]
    return torch.cat(parts, dim=1).transpose(0, 1)[None].contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    return None  # the row boundaries are the mask


AttentionInterface.register(PACKED, packed_attention)
AttentionMaskInterface.register(PACKED, _no_mask)


@dataclass
class PackedRows:
    """n right-padded rows as one sequence, shortest first: `input_ids`/`position_ids` [1, S],
    `cu_seqlens` [n + 1] (the k-th packed row is [cu[k], cu[k+1])), and where to read each row's
    response logits and last state (in the rows' own order)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    logit_pos: torch.Tensor  # [n, T]: the packed position whose logits predict response token t
    last_pos: torch.Tensor  # [n]: the packed position of each row's last token

    @classmethod
    def of(cls, input_ids: torch.Tensor, lengths: torch.Tensor, response_pos: torch.Tensor) -> PackedRows:
        """input_ids [n, L] right-padded, lengths [n] (real tokens per row), response_pos [n, T]
        (row positions; those past a row's end are padding and read its last position)."""
        width = input_ids.shape[1]
        order = torch.argsort(lengths, stable=True)  # rows of one length side by side: one attention call
        real = torch.arange(width, device=input_ids.device)[None, :] < lengths[order, None]
        packed_starts = torch.cumsum(lengths[order], 0) - lengths[order]
        starts = torch.empty_like(packed_starts)
        starts[order] = packed_starts
        cu = torch.cat([packed_starts, lengths.sum()[None]]).to(torch.int32)
        return cls(
            input_ids=input_ids[order][real][None],
            position_ids=torch.arange(width, device=input_ids.device).expand_as(input_ids)[real][None],
            cu_seqlens=cu,
            max_len=int(lengths.max()),
            logit_pos=starts[:, None] + torch.minimum(response_pos, (lengths - 1)[:, None]),
            last_pos=starts + lengths - 1,
        )

    def forward_kwargs(self) -> dict:
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_len,
            "max_length_k": self.max_len,
        }


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the model's forward computes logits only at given positions (`logits_to_keep`)."""
    return _forward_keeps_logits(type(model))


@functools.cache  # once per model class: every learner forward asks
def _forward_keeps_logits(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def use_packed_attention(model: torch.nn.Module) -> None:
    """From now on the model's attention is `packed_attention` (the learner's own copies only;
    the setting is not saved with the model)."""
    model.set_attn_implementation(PACKED)


@torch.no_grad()
def packing_misfit(model: torch.nn.Module, tol: float = 1e-3) -> str | None:
    """Why the model cannot be packed, or None: four rows (longer than its sliding window, two of
    one length) packed must give each row's logits as its own forward does, alone."""
    config = model.config
    previous = config._attn_implementation
    try:
        model.set_attn_implementation(PACKED)
    except (ValueError, ImportError) as e:
        return f"its attention implementation cannot be set ({e})"
    if config._attn_implementation != PACKED:
        return "its attention does not go through transformers' AttentionInterface"
    model.set_attn_implementation(previous)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    window = getattr(config, "sliding_window", None)
    longest = 9 if not isinstance(window, int) else window + 4
    lengths = [longest, 4, longest, longest - 2]  # two of one length: one attention call
    rows = [torch.randint(3, vocab, (n,), generator=gen).to(device) for n in lengths]
    training = model.training
    model.eval()
    try:
        alone = [model(input_ids=r[None], use_cache=False).logits[0].float() for r in rows]
        padded = torch.zeros(len(rows), longest, dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            padded[i, : len(r)] = r
        length = torch.tensor(lengths, device=device)
        pos = torch.arange(longest, device=device).expand(len(rows), -1)
        packed = PackedRows.of(padded, length, pos)
        model.set_attn_implementation(PACKED)
        try:
            logits = model(**packed.forward_kwargs(), use_cache=False).logits[0].float()
        finally:
            model.set_attn_implementation(previous)
    except Exception as e:  # noqa: BLE001 - any failure of the packed forward is the reason
        return f"the packed forward fails: {type(e).__name__}: {e}"
    finally:
        model.train(training)
    worst = 0.0
    for i, expected in enumerate(alone):
        got = logits[packed.logit_pos[i, : lengths[i]]]
        worst = max(worst, ((got - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item())
    if not worst <= (tol if next(model.parameters()).dtype == torch.float32 else 5e-2):
        return f"packed logits differ from the model's own forward by {worst:.2e} (relative)"
    return None
