"""Per-tensor checksums of the weights, to check that an engine holds exactly the learner's.

The probe check (logprobs of a fixed response) sees only the weights its tokens reach: an MoE
expert that only the model's own responses route to can be stale and pass it. A checksum per
tensor sees every one. Both sides checksum the same bits: the engine reports its tensors' dtypes
with their sums, and the learner casts each of its tensors to that dtype first, as the engine's
in-place copy did.

A checksum is three float64 numbers over the flat tensor x: sum(x), sum(x_i * w_i) with
w_i = 1 + (i mod 1009) / 1009 (a permutation, such as two experts swapped, changes it), and
sum(|x_i| * w_i), the scale the first two are compared at.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

PERIOD = 1009
CHUNK = PERIOD * 4096  # elements per step (a multiple of PERIOD: every chunk reuses one weight vector)
RELATIVE_TOLERANCE = 1e-12  # float64 sums of the same bits in another order agree to ~1e-15

Checksum = tuple[str, float, float, float]  # dtype, sum, weighted sum, weighted sum of |x|

_weights: dict[torch.device, torch.Tensor] = {}


def _position_weights(device: torch.device) -> torch.Tensor:
    if device not in _weights:
        _weights[device] = 1.0 + torch.arange(CHUNK, device=device, dtype=torch.float64) % PERIOD / PERIOD
    return _weights[device]


@torch.no_grad()
def tensor_checksum(tensor: torch.Tensor) -> Checksum:
    flat = tensor.detach().reshape(-1)
    w = _position_weights(flat.device)
    total = weighted = scale = 0.0
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start : start + CHUNK].to(torch.float64)
        part_w = w[: part.numel()]
        total += float(part.sum())
        weighted += float(part @ part_w)
        scale += float(part.abs() @ part_w)
    return str(tensor.dtype).removeprefix("torch."), total, weighted, scale


def checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Checksum]:
    return {name: tensor_checksum(t) for name, t in named_tensors}


def checksums_as(named_tensors: Iterable[tuple[str, torch.Tensor]], dtypes: dict[str, str]) -> dict[str, Checksum]:
    """The learner's side: each tensor the engine has (`dtypes`, from its checksums), cast to the
    engine's dtype first; tensors the engine does not hold are left out."""
    out = {}
    for name, tensor in named_tensors:
        if name in dtypes:
            out[name] = tensor_checksum(tensor.detach().to(getattr(torch, dtypes[name])))
    return out


def differing(expected: dict[str, Checksum], got: dict[str, Checksum]) -> list[str]:
    """Names of `expected` (the learner's) whose checksum the engine's disagrees with, or that the
    engine does not report, sorted. NaN never agrees. The engine's own extra tensors (buffers,
    rotary tables) are not compared."""
    names = []
    for name in sorted(expected):
        a, b = expected[name], got.get(name)
        if b is None or a[0] != b[0]:
            names.append(name)
            continue
        tolerance = RELATIVE_TOLERANCE * max(a[3], b[3], 1e-30)
        if not (abs(a[1] - b[1]) <= tolerance and abs(a[2] - b[2]) <= tolerance):
            names.append(name)
    return names


def checksum_mismatch(expected: dict[str, Checksum], engines: list[dict[str, Checksum] | None]) -> str | None:
    """What is wrong, in words, for the first engine (of those that report checksums) whose tensors
    differ from the learner's `expected`; None when every one agrees."""
    for index, got in enumerate(engines):
        names = [] if got is None else differing(expected, got)
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            return (
                f"rollout engine {index} holds {len(names)} of the learner's {len(expected)} weight tensors with "
                f"other values (per-tensor checksums, weights.checksum_every): {shown}"
            )
    return None
