"""The learner's forward passes: the policy's response logprobs (and entropy, router aux loss)
and the critic's values, over padded rows or packed ones (packing.py).

At long lengths the output head is the memory: logits [T, V] in float32 are 19 GB at T = 32k and
a 150k vocabulary, and the entropy's softmax as much again. With `use_logit_chunks` the head's
input (the hidden states at the response positions) is kept instead, and log π and the entropy
are computed from it `chunk` positions at a time (`ChunkedHead`), each chunk's logits recomputed
in backward: the peak is one chunk's [C, V], whatever T."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch
from transformers import AutoModel

from slime.algorithms.batch import Batch, collate
from slime.algorithms.core import entropy_from_logits
from slime.engines.routing import recompute_as_forward, replayed_routing
from slime.learner.packing import PACKED, PackedRows, keeps_logits
from slime.model import from_pretrained
from slime.sample import Sample

LOGIT_CHUNK = "slime_logit_chunk_tokens"  # set on a model by use_logit_chunks; the reference's deep copy keeps it


def response_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float,
    with_entropy: bool = False,
    with_aux: bool = False,
    replay: bool = False,
    packed: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log π(a_t|s_t) of each response token under `temperature` (as the engine samples), [N, T].
    replay: the response tokens go through the experts the engine recorded (routing replay).
    packed: the rows run as one padding-free sequence (packing.py; the model must use its attention).
    Logits are computed only where they predict a response token; log π = logit − logsumexp, with
    no [N, T, V] log-softmax. entropy_grad=False: the entropy is a statistic, outside the graph.
    chunk_tokens: log π and the entropy from the head's input, that many positions at a time, with
    no [N, T, V] tensor (ChunkedHead); None: the model's setting (use_logit_chunks); 0: whole logits."""
    chunk = getattr(model, LOGIT_CHUNK, 0) if chunk_tokens is None else chunk_tokens
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
    keep = keeps_logits(model)
    if keep:
        kwargs["logits_to_keep"] = positions.reshape(-1) if packed else positions
    with replaying, _head_input(model) if chunk > 0 else contextlib.nullcontext() as captured:
        out = model(**inputs, use_cache=False, **kwargs)
    aux = getattr(out, "aux_loss", None) if with_aux else None
    if chunk > 0:
        hidden = captured[0] if keep else _at(captured[0], positions, packed)
        logp, entropy = chunked_logprobs(
            model, hidden.reshape(n * t, -1), batch.response_ids.reshape(-1), temperature, chunk, with_entropy
        )
        if entropy is not None and not (entropy_grad and torch.is_grad_enabled()):
            entropy = entropy.detach()
        return logp.view(n, t), None if entropy is None else entropy.view(n, t), aux
    logits = out.logits.view(n, t, -1) if keep else _at(out.logits, positions, packed)
    logits = logits.float() / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, batch.response_ids[..., None]).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    return logp, entropy, aux


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Activation checkpointing on the model's layers (non-reentrant), each layer's recomputation in
    backward routing as its forward did: routing replay's experts are in force only during the
    forward (`replayed_routing`), backward runs later (routing.recompute_as_forward)."""
    kwargs = {"use_reentrant": False, "context_fn": recompute_as_forward}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.25's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _at(x: torch.Tensor, positions: torch.Tensor, packed: bool) -> torch.Tensor:
    """x [N, L, D] (packed: [1, S, D]) at positions [N, T] -> [N, T, D]."""
    if packed:
        return x[0, positions]
    return x.gather(1, positions[..., None].expand(-1, -1, x.shape[-1]))


@contextlib.contextmanager
def _head_input(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside, the model's output head keeps its input (the hidden states it would project) in the
    yielded list and returns a [..., 1] stand-in: the model's forward builds no logits."""
    head = model.get_output_embeddings()
    captured: list[torch.Tensor] = []
    own = head.__dict__.get("forward")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(hidden)
        return hidden.new_zeros(hidden.shape[:-1] + (1,))

    head.forward = forward
    try:
        yield captured
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    if len(captured) != 1:
        raise RuntimeError(f"the output head ran {len(captured)} times in one forward, not once")


def logit_postprocess(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | str:
    """What the model's forward does to its head's output before returning the logits, as a
    function, or why it is not known: Cohere's `logit_scale` (×), Granite's `logits_scaling` (÷),
    Gemma's `final_logit_softcapping` (cap · tanh(z / cap)); nothing for the others.
    `logit_chunk_misfit` checks the result against the model's own logits."""
    config = model.config
    scale = getattr(model, "logit_scale", None)
    divisor = getattr(config, "logits_scaling", None)
    cap = getattr(model, "final_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None)
    for name, value in (("logit_scale", scale), ("logits_scaling", divisor), ("final_logit_softcapping", cap)):
        if value is not None and not isinstance(value, (int, float)):
            return f"its {name} is a {type(value).__name__}, not a number"

    def post(z: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            z = z * scale
        if divisor is not None:
            z = z / divisor
        if cap:
            z = torch.tanh(z / cap) * cap
        return z

    return post


def chunked_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    chunk: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π of `tokens` [M] and the entropy [M] (or None) from the head's input `hidden` [M, H],
    `chunk` positions at a time, through the model's own head (any module: bias, adapters) and
    `logit_postprocess`."""
    head = model.get_output_embeddings()
    post = logit_postprocess(model)
    if isinstance(post, str):
        raise ValueError(f"chunked logits: {post}")
    names = [name for name, _ in head.named_parameters()]
    params = [p for _, p in head.named_parameters()]

    def head_out(h: torch.Tensor, ps: list[torch.Tensor]) -> torch.Tensor:
        return post(torch.func.functional_call(head, dict(zip(names, ps)), (h,)))

    logp, entropy = ChunkedHead.apply(hidden, tokens, head_out, float(temperature), int(chunk), with_entropy, *params)
    return logp, entropy if with_entropy else None


class ChunkedHead(torch.autograd.Function):
    """log π and entropy of M positions from their hidden states, `chunk` positions at a time.
    Forward keeps no logits; backward recomputes each chunk's and takes its gradient in closed
    form (d log π_a / dz = onehot(a) − p, dH / dz = −p (log p + H)), then through the head."""

    @staticmethod
    def forward(ctx, hidden, tokens, head_out, temperature, chunk, with_entropy, *params):
        ctx.set_materialize_grads(False)
        m = hidden.shape[0]
        logp = torch.empty(m, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(m if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        scratch = _Scratch()
        ctx.rng = []  # each chunk's RNG state: a head with dropout (LoRA's) draws the same masks again in backward
        for s in range(0, m, chunk):
            ctx.rng.append(_rng_state(hidden.device))
            z = _tempered(head_out(hidden[s : s + chunk], params), temperature, scratch)
            log_p = torch.log_softmax(z, dim=-1, out=scratch.get(1, z))
            del z
            logp[s : s + chunk] = log_p.gather(1, tokens[s : s + chunk, None]).squeeze(1)
            if with_entropy:
                entropy[s : s + chunk] = -_rowdot(torch.exp(log_p, out=scratch.get(2, log_p)), log_p)
        ctx.save_for_backward(hidden, tokens, *params)
        ctx.head_out, ctx.temperature, ctx.chunk = head_out, temperature, chunk
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, tokens, *params = ctx.saved_tensors
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_p: list[torch.Tensor | None] = [None] * len(params)
        with torch.random.fork_rng(devices=[hidden.device] if hidden.device.type == "cuda" else []):
            ChunkedHead._recompute(ctx, hidden, tokens, params, g_logp, g_entropy, grad_h, grad_p)
        # a zero gradient, not None, where every chunk was skipped: the whole path's, and FSDP2
        # reduce-scatters the gradients that exist, which every rank must have alike (empty passes)
        need_p = ctx.needs_input_grad[6:]
        grad_p = [
            (torch.zeros_like(p) if g is None else g.to(p.dtype)) if need else None
            for g, p, need in zip(grad_p, params, need_p)
        ]
        return (grad_h, None, None, None, None, None, *grad_p)

    @staticmethod
    def _recompute(ctx, hidden, tokens, params, g_logp, g_entropy, grad_h, grad_p) -> None:
        """Each chunk's logits again, their gradient, and through the head into grad_h and grad_p."""
        need_h, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[6:]
        scratch = _Scratch()
        for k, s in enumerate(range(0, hidden.shape[0], ctx.chunk)):
            # d/d(head output) = d/dz / temperature: the [C] upstream gradients carry the 1/T
            gl = None if g_logp is None else g_logp[s : s + ctx.chunk].float() / ctx.temperature
            ge = None if g_entropy is None else g_entropy[s : s + ctx.chunk].float() / ctx.temperature
            if not any(g is not None and bool(g.any()) for g in (gl, ge)):
                continue  # padding: nothing flows back from these positions
            _set_rng_state(hidden.device, ctx.rng[k])
            h = hidden[s : s + ctx.chunk].detach().requires_grad_(need_h)
            leaves = [p.detach().requires_grad_(need) for p, need in zip(params, need_p)]
            with torch.enable_grad():
                out = ctx.head_out(h, leaves)
            with torch.no_grad():
                grad_out = _logit_grad(
                    _tempered(out.detach(), ctx.temperature, scratch), tokens[s : s + ctx.chunk], gl, ge, scratch
                )
            wrt = ([h] if need_h else []) + [p for p, need in zip(leaves, need_p) if need]
            grads = list(torch.autograd.grad(out, wrt, grad_out.to(out.dtype)))
            del out, grad_out
            if need_h:
                grad_h[s : s + ctx.chunk] = grads.pop(0)
            for i, need in enumerate(need_p):
                if need:
                    g = grads.pop(0)  # summed over chunks in float32 (a bf16 head's too), cast once
                    grad_p[i] = g.float() if grad_p[i] is None else grad_p[i].add_(g)


class _Scratch:
    """[C, V] float32 tensors allocated once per pass and reused by every chunk: on a CPU a fresh
    tensor of that size costs, in page faults, as much as the arithmetic done in it."""

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}

    def get(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(slot)
        if buf is None or buf.shape[0] < like.shape[0] or buf.shape[1:] != like.shape[1:]:
            buf = self.buffers[slot] = torch.empty(like.shape, dtype=torch.float32, device=like.device)
        return buf[: like.shape[0]]


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _tempered(out: torch.Tensor, temperature: float, scratch: _Scratch) -> torch.Tensor:
    """The head's output as the engine samples from it, float32 / temperature (as the whole path:
    the division in float32); `out` itself when nothing changes it, else in scratch slot 0."""
    if out.dtype == torch.float32:
        return out if temperature == 1.0 else torch.div(out, temperature, out=scratch.get(0, out))
    z = scratch.get(0, out).copy_(out)
    return z if temperature == 1.0 else z.div_(temperature)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a[c, v] b[c, v] -> [C], without an [C, V] product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _logit_grad(z: torch.Tensor, tokens: torch.Tensor, gl: torch.Tensor | None, ge: torch.Tensor | None, scratch):
    """The gradient on the logits z [C, V] of Σ gl · log p(token) + Σ ge · H(p), in a scratch slot
    (z is not changed): p · (−gl − ge (log p + H)) + gl · onehot(token)."""
    log_p = torch.log_softmax(z, dim=-1, out=scratch.get(1, z))
    p = torch.exp(log_p, out=scratch.get(2, z))
    gl = torch.zeros_like(log_p[:, 0]) if gl is None else gl
    if ge is None:
        grad = p.mul_(-gl[:, None])
    else:
        h = -_rowdot(p, log_p)
        grad = log_p.mul_(-ge[:, None]).add_((-gl - ge * h)[:, None]).mul_(p)
    return grad.scatter_add_(1, tokens[:, None], gl[:, None])


def use_logit_chunks(model: torch.nn.Module, chunk_tokens: int) -> str | None:
    """From now on `response_logprobs` computes the model's log π and entropy `chunk_tokens`
    positions at a time (also for its deep copies: the reference model), when its chunked numbers
    equal its own logits'. Returns why not (it keeps whole logits), or None."""
    setattr(model, LOGIT_CHUNK, 0)
    if chunk_tokens <= 0:
        return "learner.logit_chunk_tokens=0"
    why = logit_chunk_misfit(model)
    if why is None:
        setattr(model, LOGIT_CHUNK, int(chunk_tokens))
    return why


@torch.no_grad()
def logit_chunk_misfit(model: torch.nn.Module, tol: float = 1e-4) -> str | None:
    """Why the model's log π and entropy cannot be computed from its head's input, or None: its
    head is one module called once on the hidden states, what its forward does to the head's
    output is known (logit_postprocess), and on two rows the chunked numbers equal those of its
    own logits (packed when its attention is the packed one)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Module):
        return "it has no output head module (get_output_embeddings)"
    post = logit_postprocess(model)
    if isinstance(post, str):
        return post
    vocab = int(model.get_input_embeddings().weight.shape[0])
    device = next(model.parameters()).device
    rng = np.random.default_rng(0)
    samples = []
    for i, (p, r) in enumerate([(3, 7), (5, 4)]):
        s = Sample(group_id="chunk_probe", index=i, prompt_ids=rng.integers(3, vocab, p).tolist(), max_new_tokens=r)
        s.append(rng.integers(3, vocab, r).tolist(), np.zeros(r), 0)
        samples.append(s)
    batch = collate(samples, [0, 0], pad_id=0).to(device)
    packed = model.config._attn_implementation == PACKED
    training = model.training
    model.eval()
    try:
        whole = response_logprobs(model, batch, 0.7, with_entropy=True, packed=packed, chunk_tokens=0)
        try:
            chunked = response_logprobs(model, batch, 0.7, with_entropy=True, packed=packed, chunk_tokens=3)
        except Exception as e:  # noqa: BLE001 - any failure of the chunked forward is the reason
            return f"the chunked forward fails: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - nothing to compare with
        return f"its own {'packed' if packed else 'padded'} forward fails: {type(e).__name__}: {e}"
    finally:
        model.train(training)
    mask = batch.mask > 0
    worst = 0.0
    for a, b in zip(whole[:2], chunked[:2]):
        a, b = a[mask], b[mask]
        worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp_min(1.0)).item())
    if not worst <= (tol if next(model.parameters()).dtype in (torch.float32, torch.float64) else 5e-2):
        return f"chunked log-probs differ from its own logits' by {worst:.2e} (relative): an unknown output transform"
    return None


def _load_backbone(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    """The policy checkpoint's backbone (AutoModel), without its output head: transformers' load
    report is shown only when it names more than the head's keys, deliberately not loaded (unexpected
    lm_head.*): a missing, mismatched or other unexpected key, or a failed load."""
    report = logging.getLogger("transformers.modeling_utils")
    held = _HeldLoadReport()
    report.addFilter(held)
    try:
        backbone, info = from_pretrained(AutoModel, model_dir, dtype=dtype, output_loading_info=True)
        others = {k for k in info["unexpected_keys"] if not k.startswith("lm_head.")}
        if not (others or info["missing_keys"] or info["mismatched_keys"] or info["error_msgs"]):
            held.records.clear()
    finally:
        report.removeFilter(held)
        for record in held.records:  # what it would have logged
            report.handle(record)
    return backbone


class _HeldLoadReport(logging.Filter):
    """Holds back transformers' LOAD REPORT records (the caller logs them or drops them)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.records.append(record)
            return False
        return True


class ValueModel(torch.nn.Module):
    """Critic: the policy's backbone with a scalar head; V(s_t) read at the same positions as π."""

    def __init__(self, model_dir: str, dtype: torch.dtype):
        super().__init__()
        self.backbone = _load_backbone(model_dir, dtype)
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
