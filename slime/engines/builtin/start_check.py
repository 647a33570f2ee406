"""The built-in engine's start-up check: does a path compute what the model's own forward does?

Two unequal prompts are prefilled and three tokens decoded on the path (a fast path, or the Hugging
Face path: a model whose state a `DynamicCache` does not hold fails there), and every position's
logits are compared with the model's forward over the same tokens (float32: 1e-3 relative;
lower precision: 5e-2). In lower precision a router near a tie can choose other experts in the
two forwards, so there the model's forward takes the experts the fast path chose
(`slime.engines.routing.RouterTrace`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from slime.engines.routing import RouterTrace, routers_of

if TYPE_CHECKING:
    from slime.engines.builtin.fast_decoder import FastDecoder
    from slime.engines.builtin.hf_batch import HfBatch


@torch.inference_mode()
def agrees_with_model(
    model: torch.nn.Module, fast: FastDecoder | HfBatch, tol: float = 1e-3, force_routing: bool | None = None
) -> str | None:
    """Prefill two unequal prompts and decode 3 tokens both ways; a mismatch is the reason.

    ``force_routing`` (default: when the weights are not float32): the model's forward takes the
    experts and weights the fast path's routers chose. In bf16 the two forwards round differently
    (attention above all), a router near a tie can then pick another expert in one of them, and
    the logits differ by far more than rounding although both are right; with the same routing
    like is compared with like, and a fast path that computes its experts wrong still disagrees."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    # Longer than a sliding window, when the model has one, so that the window is exercised.
    window = getattr(model.config, "sliding_window", None)
    max_len = getattr(fast, "max_len", 128)  # the Hugging Face path has no cache length of its own
    longest = 7 if not isinstance(window, int) else min(window + 3, max(7, max_len // 2))
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (longest, 3)]
    steps = [torch.randint(0, vocab, (2,), generator=gen) for _ in range(3)]
    if force_routing is None:
        force_routing = fast.dtype != torch.float32
    trace = RouterTrace(_routers_called(model, fast) if force_routing else [])
    with trace.recording():
        got = [fast.prefill(prompts)]
        for j, tokens in enumerate(steps):
            positions = torch.tensor([len(p) + j for p in prompts], device=fast.device)
            got.append(fast.decode(tokens.to(fast.device), positions))
    worst = 0.0
    for r, prompt in enumerate(prompts):
        seq = prompt + [int(t[r]) for t in steps]
        ids = torch.tensor([seq], device=fast.device)
        chosen = _row_routing(trace, prompts, r, len(steps))
        with trace.forcing(routers_of(model), chosen) if chosen else contextlib.nullcontext():
            ref = model(input_ids=ids, use_cache=False).logits[0].float()
        for j, logits in enumerate(got):
            expected = ref[len(prompt) - 1 + j]
            diff = (logits[r].float() - expected).abs().max().item()
            scale = max(1.0, expected.abs().max().item())
            worst = max(worst, diff / scale)
    fast.select([])
    if not worst <= (tol if fast.dtype == torch.float32 else 5e-2):
        return f"logits differ from the model's forward by {worst:.2e} (relative)"
    return None


def _routers_called(model: torch.nn.Module, fast: FastDecoder) -> list[torch.nn.Module]:
    """The routers the fast path calls, in layer order (the model's own, unless a layer holds another)."""
    own = routers_of(model)
    layers = getattr(fast, "layers", None)
    if layers is None:
        return own
    hand_written = [L.router for L in layers if L.router is not None]
    return hand_written if len(hand_written) == len(own) else own


def _row_routing(
    trace: RouterTrace, prompts: list[list[int]], row: int, decode_steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per router, the (weights, experts) of row ``row``'s tokens in order: the prefill fed every
    prompt flat, then each decode step one token per row. None when the calls do not fit that."""
    start = sum(len(p) for p in prompts[:row])
    chosen = []
    for calls in trace.calls:
        if len(calls) != 1 + decode_steps:
            return None
        parts = [(w[start : start + len(prompts[row])], e[start : start + len(prompts[row])]) for w, e in calls[:1]]
        parts += [(w[row : row + 1], e[row : row + 1]) for w, e in calls[1:]]
        chosen.append((torch.cat([w for w, _ in parts]), torch.cat([e for _, e in parts])))
    return chosen or None
