"""Per-expert load of an MoE rollout engine: routed-token counts from forward hooks on the routers.

A hook adds each MoE layer's routed tokens into a per-layer count on the engine's device (an
`index_add_`: no wait on the host, which a `bincount` on CUDA would cost per layer and step); the
worker moves the totals to the buffer (`expert_load` hash) every few seconds with `take()`.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from slime.engines.routing import routers_of


class ExpertLoadRecorder:
    def __init__(self, routers: list[torch.nn.Module]):
        self.num_experts = int(routers[0].num_experts)
        self.lock = threading.Lock()
        self.counts = np.zeros((len(routers), self.num_experts), dtype=np.int64)
        self._device_counts: list[torch.Tensor | None] = [None] * len(routers)
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    @classmethod
    def attach(cls, model: torch.nn.Module | None) -> ExpertLoadRecorder | None:
        """A recorder on every router of `model`; None for a dense model (or none at all)."""
        if model is None:
            return None
        routers = routers_of(model)
        return cls(routers) if routers else None

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, inputs: tuple, output: tuple) -> None:
            indices = output[-1] if isinstance(output, tuple) else None
            if indices is None or indices.dtype not in (torch.int64, torch.int32):
                return
            flat = indices.reshape(-1)
            with self.lock:
                counts = self._device_counts[layer]
                if counts is None:
                    # A normal tensor even when the engine's step runs under inference_mode: the
                    # probe's forward (no_grad, not inference_mode) adds to it too.
                    with torch.inference_mode(False):
                        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
                    self._device_counts[layer] = counts
                counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))

        return hook

    def take(self) -> np.ndarray:
        """Counts (layers, experts) since the last take; zeros when nothing was routed."""
        with self.lock:
            pending, self._device_counts = self._device_counts, [None] * len(self._device_counts)
        out = np.zeros_like(self.counts)
        for layer, counts in enumerate(pending):
            if counts is not None:
                out[layer] = counts.cpu().numpy()
        return out

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
