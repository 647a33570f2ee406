"""Routing replay (R3, as slime and SkyRL do it): the engine records which experts each MoE layer
chose for every sampled token, and the learner routes the same tokens through the same experts,
so that a router near a tie cannot send the learner's forward down other experts than the ones
that produced the token (a train-inference mismatch no importance weight repairs).

What is recorded for response token t: at every MoE layer, the top-k experts of the position whose
logits sampled t (the last prompt position for t = 0, else response token t-1), as
`layers x top_k` bytes (expert ids < 255; 255 = none recorded, e.g. an environment's tokens). The
learner replays them at exactly those positions (`Batch.response_pos`); every other position
routes as usual.

Replay works for routers that take softmax then top-k (Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek-V2 in
transformers; `replay_misfit` checks it on the model): the router's probabilities are computed as
usual, and the recorded experts' probabilities (renormalised when the router renormalises) weight
their outputs, so the router still learns. Grouped or biased routing (DeepSeek-V3, GLM-4.5,
gpt-oss) is refused at start, naming the router.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

NO_ROUTE = 255  # a token with no recorded routing


def routers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Hugging Face MoE routers (Qwen3-MoE's TopKRouter and the like), in layer order. They expose
    top_k and num_experts and return (logits, scores, expert indices)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "top_k") and hasattr(m, "num_experts") and type(m).__name__.endswith("Router")
    ]


def replay_misfit(model: torch.nn.Module) -> str | None:
    """Why the learner cannot replay this model's routing (None: it can)."""
    routers = routers_of(model)
    if not routers:
        return "the model has no MoE router"
    r = routers[0]
    if not isinstance(getattr(r, "weight", None), torch.Tensor) or r.num_experts > NO_ROUTE:
        return f"{type(r).__name__} is not a linear router over at most {NO_ROUTE} experts"
    # The replaying forward must be the router's own when nothing is forced: checked on random input,
    # with and without renormalising the chosen probabilities (Mixtral renormalises by construction).
    with torch.no_grad():
        hidden = torch.randn(16, r.weight.shape[-1], dtype=r.weight.dtype, device=r.weight.device)
        _, weights, experts = r(hidden)
        none = torch.full((0, int(r.top_k)), -1, dtype=torch.long, device=hidden.device)
        for normalize in (bool(getattr(r, "norm_topk_prob", False)), True):
            own = _replaying_forward(r, none, normalize)(hidden)
            if torch.equal(experts, own[2]) and torch.allclose(weights.float(), own[1].float(), atol=1e-5):
                for router in routers:
                    router.slime_replay_normalize = normalize
                return None
    return f"{type(r).__name__} does not route by softmax then top-k (grouped, biased or other routing)"


class RoutingRecorder:
    """Forward hooks on every router of the engine's model; `rows(last)` gives, after a forward, each
    row's experts at its sampled position as [rows, layers * top_k] uint8."""

    def __init__(self, model: torch.nn.Module):
        self.routers = routers_of(model)
        if not self.routers:
            raise ValueError("routing replay: the engine's model has no MoE router to record")
        self.top_k = int(self.routers[0].top_k)
        self._step: list[torch.Tensor | None] = [None] * len(self.routers)
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, inputs: tuple, output: tuple) -> None:
            indices = output[-1] if isinstance(output, tuple) else None
            if indices is not None and indices.dtype in (torch.int64, torch.int32):
                self._step[layer] = indices.reshape(-1, self.top_k)

        return hook

    def start(self) -> None:
        self._step = [None] * len(self.routers)

    def rows(self, last: torch.Tensor) -> np.ndarray:
        """[rows, layers * top_k] experts of the flat positions `last` in the forward just run."""
        if any(s is None for s in self._step):
            raise RuntimeError("routing replay: a router did not run in this forward")
        chosen = torch.stack([s[last] for s in self._step], dim=1)  # [rows, layers, k]
        return chosen.reshape(len(last), -1).to(torch.uint8).cpu().numpy()


@contextlib.contextmanager
def replayed_routing(model: torch.nn.Module, routing: torch.Tensor, response_pos: torch.Tensor, seq_len: int):
    """Inside: every router of `model` takes the recorded experts at the response positions.
    routing [N, T, layers * top_k] (int, NO_ROUTE where none), response_pos [N, T], seq_len the
    forward's padded length (routers see the [N * seq_len] flattened tokens)."""
    routers = routers_of(model)
    if routers and not hasattr(routers[0], "slime_replay_normalize") and (why := replay_misfit(model)):
        raise ValueError(f"routing replay: {why}")
    n, t, width = routing.shape
    k = width // len(routers)
    flat_pos = (torch.arange(n, device=routing.device)[:, None] * seq_len + response_pos).reshape(-1)
    forced = []
    for layer in range(len(routers)):
        chosen = torch.full((n * seq_len, k), -1, dtype=torch.long, device=routing.device)
        recorded = routing[:, :, layer * k : (layer + 1) * k].reshape(-1, k).long()
        valid = (recorded != NO_ROUTE).all(-1)
        chosen[flat_pos[valid]] = recorded[valid]
        forced.append(chosen)
    global _in_force
    replaying = [(r, _replaying_forward(r, f, r.slime_replay_normalize)) for r, f in zip(routers, forced)]
    outer, _in_force = _in_force, replaying
    try:
        with _Forcing(replaying):
            yield
    finally:
        _in_force = outer


# The replaying forwards that replayed_routing has put in force now: what `recompute_as_forward`
# captures in each checkpointed layer's forward.
_in_force: list[tuple[torch.nn.Module, object]] = []


def recompute_as_forward() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`context_fn` of torch.utils.checkpoint (non-reentrant) for activation checkpointing: called in
    each checkpointed layer's forward, it returns the context of that layer's recomputation in
    backward, which puts the replaying forwards in force at the forward back on its routers. Backward
    runs after `replayed_routing` has ended: without this, the recomputation would route by itself,
    through other experts than the forward (wrong gradients, or checkpoint's tensor-count error)."""
    return contextlib.nullcontext(), _Forcing(_in_force) if _in_force else contextlib.nullcontext()


class _Forcing:
    """Inside: each router takes its given forward; outside, its own again. Re-entrant (a graph
    backpropagated twice recomputes twice)."""

    def __init__(self, forwards: list[tuple[torch.nn.Module, object]]):
        self.forwards = list(forwards)
        self.saved: list[list[object]] = []

    def __enter__(self) -> None:
        self.saved.append([r.__dict__.get("forward") for r, _ in self.forwards])
        for r, forward in self.forwards:
            r.forward = forward

    def __exit__(self, *exc) -> None:
        for (r, _), own in zip(self.forwards, self.saved.pop()):
            if own is None:
                del r.forward  # the class's forward again
            else:
                r.forward = own


def _replaying_forward(router: torch.nn.Module, forced: torch.Tensor, normalize: bool):
    def forward(hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, router.weight.shape[-1])
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        _, top = torch.topk(probs, router.top_k, dim=-1)
        if forced.shape[0] == top.shape[0]:
            experts = torch.where(forced[:, :1] >= 0, forced, top)
        else:  # a forward of another shape (a probe): the router's own choice
            experts = top
        weights = probs.gather(-1, experts)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts

    return forward


class RouterTrace:
    """The experts and weights each router call chose (`recording`), then a forward that takes
    given ones instead of its own (`forcing`): the engine's start check runs the model's forward
    over the routing its fast path chose, so that a near-tie broken the other way by rounding is
    not taken for a wrong fast path. Routers return (logits, weights, experts)."""

    def __init__(self, routers: list[torch.nn.Module]):
        self.routers = routers
        self.calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in routers]

    @contextlib.contextmanager
    def recording(self):
        handles = [r.register_forward_hook(self._record(i)) for i, r in enumerate(self.routers)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _record(self, index: int):
        def hook(module: torch.nn.Module, inputs: tuple, output) -> None:
            if isinstance(output, tuple) and len(output) >= 3:
                self.calls[index].append((output[-2].detach().clone(), output[-1].detach().clone()))

        return hook

    @contextlib.contextmanager
    def forcing(self, routers: list[torch.nn.Module], chosen: list[tuple[torch.Tensor, torch.Tensor]]):
        """Inside: ``routers[i]`` returns ``chosen[i]`` (weights, experts) for a call of as many tokens."""

        def hook_for(weights: torch.Tensor, experts: torch.Tensor):
            def hook(module: torch.nn.Module, inputs: tuple, output):
                if not isinstance(output, tuple) or tuple(output[-1].shape) != tuple(experts.shape):
                    return None
                return (*output[:-2], weights.to(output[-2].dtype), experts.to(output[-1].dtype))

            return hook

        handles = [r.register_forward_hook(hook_for(*c)) for r, c in zip(routers, chosen)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
