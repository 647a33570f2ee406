"""LoRA pushes into the built-in engine: each adapter is merged into its module's weight, in place.

With ``learner.lora`` set, every ``update_weights`` carries ``{module}.lora_A.weight`` [rank, in]
and ``{module}.lora_B.weight`` [out, rank] per adapted module (`slime.engines.contract.adapter_pairs`
reads and checks the push). `LoraMerge` keeps a copy of each adapted module's loaded weight
W_base, taken the first time the module is pushed (before anything is merged into it), and sets

    W = W_base + scaling * B @ A        (scaling = alpha / rank; computed in float32, cast to W's dtype)

by ``copy_`` into the parameter itself: the path a full push takes, so every forward path sees it
at once (the fast decoder's layers hold views of the model's own tensors, fused q/k/v included,
and CUDA graphs replay over those addresses). Each push replaces the last one's delta (W_base is
the reference, never the merged W, so nothing accumulates and pushing B = 0 gives back the loaded
model bit for bit); a module adapted before and absent from a push goes back to W_base.

Why merged rather than LoRA layers in the forward: the hand-written fast path reads plain weight
tensors, and a merged weight costs nothing per token, while an unmerged adapter adds two small
matmuls per adapted projection to every step (measured on CPU, the tiny MoE and a ~50M dense model,
docs/engines.md "LoRA pushes": a peft-injected decode step took 1.1-1.3x the merged one at batch 1,
1.0-1.2x at batch 64). The price is one merge per push (one [out, rank] x [rank, in] matmul per
module: 0.5 ms on the tiny MoE, 10 ms on the ~50M model) and the memory of the base copies: the
adapted weights once more (attention q/k/v/o of every layer by default).
"""

from __future__ import annotations

import torch

from slime.engines.contract import adapter_pairs

__all__ = ["LoraMerge"]


class LoraMerge:
    """The LoRA state of one model: its adapted modules' base weights, and the merge of a push."""

    def __init__(self, model: torch.nn.Module, scaling: float):
        if not scaling > 0:
            raise ValueError(f"lora_scaling must be > 0 (alpha / rank), got {scaling}")
        self.model = model
        self.scaling = float(scaling)
        self.base: dict[str, torch.Tensor] = {}  # module name -> its weight as loaded (W_base)
        # Weights stored under more than one name (tied embeddings): a merge into one would change the other.
        owners: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            owners[p.data_ptr()] = owners.get(p.data_ptr(), 0) + 1
        self._shared = {ptr for ptr, n in owners.items() if n > 1}

    def base_bytes(self) -> int:
        """Memory held by the base copies."""
        return sum(t.numel() * t.element_size() for t in self.base.values())

    @torch.no_grad()
    def push(self, named_tensors) -> None:
        """Merge one LoRA push. Every tensor is checked before anything is merged: a bad push
        raises ValueError naming the tensor and leaves the weights as they were."""
        pairs = adapter_pairs(named_tensors)
        targets = {module: self._target(module, a, b) for module, (a, b) in pairs.items()}
        for module, weight in targets.items():
            if module not in self.base:  # first push of this module: its weight is still W_base
                self.base[module] = weight.detach().clone()
        for module, weight in targets.items():
            a, b = pairs[module]
            base = self.base[module]
            delta = b.to(base.device, torch.float32) @ a.to(base.device, torch.float32)
            weight.copy_(torch.add(base, delta, alpha=self.scaling).to(weight.dtype))  # float32 sum
        for module, base in self.base.items():
            if module not in targets:  # adapted before, not in this push: no adapter any more
                self.model.get_submodule(module).weight.copy_(base)

    def _target(self, module: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The weight of ``module`` that this A and B adapt (ValueError naming the tensor otherwise)."""
        try:
            linear = self.model.get_submodule(module)
        except AttributeError:
            linear = None
        if not isinstance(linear, torch.nn.Linear):
            what = "no such module" if linear is None else f"a {type(linear).__name__}, not a Linear"
            raise ValueError(f"update_weights: {module}.lora_A.weight: {module!r} is {what} in the engine's model")
        weight = linear.weight
        if weight.data_ptr() in self._shared:
            raise ValueError(
                f"update_weights: {module}.lora_A.weight: {module}.weight is tied to another tensor (shared "
                "embeddings); LoRA on it would change both"
            )
        out_features, in_features = weight.shape
        if a.shape[1] != in_features:
            raise ValueError(
                f"update_weights: {module}.lora_A.weight has shape {tuple(a.shape)}; {module} takes "
                f"{in_features} inputs, so A must be [rank, {in_features}]"
            )
        if b.shape[0] != out_features:
            raise ValueError(
                f"update_weights: {module}.lora_B.weight has shape {tuple(b.shape)}; {module} gives "
                f"{out_features} outputs, so B must be [{out_features}, rank]"
            )
        return weight
