"""RoPE as the hand-written layers (`slime.engines.builtin.fast_decoder`) apply it: on the two
halves of each head's rotary dims (Llama), on interleaved pairs (GLM, Cohere), or not at all; which
one a layer uses is read off the model (`FastDecoder.fit_attention`)."""

from __future__ import annotations

import torch


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


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3)... of the first ``cos.shape[-1]`` dims (GLM,
    ERNIE 4.5, Cohere); ``cos`` and ``sin`` hold each pair's value twice (`pair_tables`)."""
    rotary = cos.shape[-1]
    head = x[..., :rotary]
    turned = torch.stack((-head[..., 1::2], head[..., 0::2]), dim=-1).flatten(-2)
    out = head * cos + turned * sin
    return out if rotary == x.shape[-1] else torch.cat((out, x[..., rotary:]), dim=-1)


def pair_tables(cos: torch.Tensor, sin: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary table as `rope_pairs` reads it: each pair's angle twice in a row. ``layout``: how
    the model's table lists the angles: "halves" (all, then all again: Llama), "pairs" (each twice
    in a row already: Cohere) or "once" (GPT-J, which repeats them itself)."""
    if layout == "halves":
        cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    elif layout == "pairs":
        cos, sin = cos[..., 0::2], sin[..., 0::2]
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


# How a layer turns its queries and keys by position (`FastDecoder.fit_attention` reads it off the model):
# RoPE on the two halves of the rotary dims (Llama), on interleaved pairs (GLM), or not at all (the
# NoPE layers of SmolLM3 or EXAONE 4).
ROTARY_MODES = ("halves", "pairs", "none")
