"""The built-in engine's batch state for any causal LM: its own forward over a ``DynamicCache``.

The fast paths (`slime.engines.builtin.fast_decoder`, `slime.engines.builtin.generic_decoder`) serve decoder-only
models over a slot KV cache; this one serves every other model, with the same operations (one forward of decode rows + prefill
groups, keep some rows, report the cache length). Rows are LEFT padded: the shorter cache is
padded on the left when batches merge, and leading columns that are padding in every row are
trimmed when rows leave.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def _left_pad(t: torch.Tensor, length: int, dim: int, value=0) -> torch.Tensor:
    """Pad ``t`` on the left along ``dim`` up to ``length``."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_full(shape, value), t], dim=dim)


class HfBatch:
    """The running rows' model state for any causal LM: its own forward over a ``DynamicCache``,
    rows left padded to a common length (``mask`` False = padding)."""

    def __init__(self, model: torch.nn.Module, decode_mask_4d: bool):
        self.model = model
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.decode_mask_4d = decode_mask_4d
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] bool

    def kv_len(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def prefill(self, contexts: list[list[int]]) -> torch.Tensor:
        dev = self.model.device
        width = max(len(c) for c in contexts)
        ids = torch.zeros(len(contexts), width, dtype=torch.long)
        mask = torch.zeros(len(contexts), width, dtype=torch.bool)
        for i, c in enumerate(contexts):
            ids[i, width - len(c) :] = torch.tensor(c, dtype=torch.long)
            mask[i, width - len(c) :] = True
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.long().cumsum(1) - 1).clamp_(min=0)
        cache = DynamicCache()
        logits = self._forward(ids, mask, pos, cache)
        if self.cache is None:
            self.cache, self.mask = cache, mask
        else:
            length = max(self.mask.shape[1], mask.shape[1])
            self.mask = torch.cat([_left_pad(self.mask, length, 1, False), _left_pad(mask, length, 1, False)])
            for a, b in zip(self.cache.layers, cache.layers):
                a.keys = torch.cat([_left_pad(a.keys, length, 2), _left_pad(b.keys, length, 2)])
                a.values = torch.cat([_left_pad(a.values, length, 2), _left_pad(b.values, length, 2)])
        return logits

    def forward(
        self, last_tokens: torch.Tensor | None, positions: torch.Tensor | None, groups: list[list[list[int]]]
    ) -> torch.Tensor:
        """Decode the existing rows (if ``last_tokens``), then prefill each group as new rows;
        the logits of every row fed, in row order."""
        logits = [self.decode(last_tokens, positions)] if last_tokens is not None else []
        logits += [self.prefill(contexts) for contexts in groups]
        return torch.cat(logits) if len(logits) > 1 else logits[0]

    def decode(self, last_tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b = last_tokens.shape[0]
        self.mask = mask = torch.cat([self.mask, self.mask.new_ones(b, 1)], dim=1)
        if self.decode_mask_4d:
            mask = mask[:, None, None, :]  # one query per row: causal == padding mask
        return self._forward(last_tokens[:, None], mask, positions[:, None], self.cache)

    def select(self, keep: list[int]) -> list[int]:
        if not keep:
            self.cache = self.mask = None
            return []
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, idx)
            layer.values = layer.values.index_select(0, idx)
        self.mask = self.mask[idx]
        # Drop leading columns that are padding in every row (bounds the cache length).
        start = int(self.mask.any(0).int().argmax())
        if start > 0:
            self.mask = self.mask[:, start:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, start:]
                layer.values = layer.values[:, :, start:]
        return keep
