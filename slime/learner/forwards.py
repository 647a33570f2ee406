"""The learner's forward passes: the policy's response logprobs (and entropy, router aux loss)
and the critic's values, over padded rows or packed ones (packing.py)."""

from __future__ import annotations

import contextlib

import torch
from transformers import AutoModel

from slime.algorithms.batch import Batch
from slime.algorithms.core import entropy_from_logits
from slime.engines.routing import replayed_routing
from slime.learner.packing import PackedRows, keeps_logits


def response_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float,
    with_entropy: bool = False,
    with_aux: bool = False,
    replay: bool = False,
    packed: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log π(a_t|s_t) of each response token under `temperature` (as the engine samples), [N, T].
    replay: the response tokens go through the experts the engine recorded (routing replay).
    packed: the rows run as one padding-free sequence (packing.py; the model must use its attention).
    Logits are computed only where they predict a response token; log π = logit − logsumexp, with
    no [N, T, V] log-softmax. entropy_grad=False: the entropy is a statistic, outside the graph."""
    kwargs = {"output_router_logits": True} if with_aux else {}
    n, t = batch.response_ids.shape
    if packed:
        rows = PackedRows.of(batch.input_ids, batch.last_pos + 1, batch.response_pos)
        inputs, positions = rows.forward_kwargs(), rows.logit_pos
        # routers see the packed sequence's S tokens as one row
        routing = batch.routing.reshape(1, n * t, -1) if batch.routing is not None else None
        routed_pos, seq_len = positions.reshape(1, -1), rows.input_ids.shape[1]
    else:
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        positions, routing, routed_pos = batch.response_pos, batch.routing, batch.response_pos
        seq_len = batch.input_ids.shape[1]
    replaying = (
        replayed_routing(model, routing, routed_pos, seq_len)
        if replay and routing is not None
        else contextlib.nullcontext()
    )
    with replaying:
        if keeps_logits(model):
            keep = positions.reshape(-1) if packed else positions
            out = model(**inputs, use_cache=False, logits_to_keep=keep, **kwargs)
            logits = out.logits.view(n, t, -1)
        else:
            out = model(**inputs, use_cache=False, **kwargs)
            if packed:
                logits = out.logits[0, positions]
            else:
                logits = out.logits.gather(1, positions[..., None].expand(-1, -1, out.logits.shape[-1]))
    logits = logits.float() / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, batch.response_ids[..., None]).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    aux = getattr(out, "aux_loss", None) if with_aux else None
    return logp, entropy, aux


class ValueModel(torch.nn.Module):
    """Critic: the policy's backbone with a scalar head; V(s_t) read at the same positions as π."""

    def __init__(self, model_dir: str, dtype: torch.dtype):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(model_dir, dtype=dtype)
        self.packed = False  # set by the learner with the backbone's attention (packing.py)
        hidden = self.backbone.config.hidden_size
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: Batch, with_last: bool = False):
        """V(s_t) for every response token [N, T]; with_last also V(s_end) after the last token [N].
        With `packed` set (packing.py) the rows run as one padding-free sequence."""
        if self.packed:
            rows = PackedRows.of(batch.input_ids, batch.last_pos + 1, batch.response_pos)
            hidden = self.backbone(**rows.forward_kwargs(), use_cache=False).last_hidden_state[0]
            values = self.head(hidden[rows.logit_pos]).squeeze(-1).float()
            last = hidden[rows.last_pos] if with_last else None
        else:
            hidden = self.backbone(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
            ).last_hidden_state
            values = self.head(hidden.gather(1, batch.response_pos[..., None].expand(-1, -1, hidden.shape[-1])))
            values = values.squeeze(-1).float()
            last = hidden[torch.arange(hidden.shape[0], device=hidden.device), batch.last_pos] if with_last else None
        if not with_last:
            return values
        return values, self.head(last).squeeze(-1).float()
