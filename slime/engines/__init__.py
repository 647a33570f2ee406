"""Rollout engines behind one contract (`slime.engines.contract`), chosen by ``rollout.engine``.

Every engine offers what the rollout worker drives from its one generation thread (the
`RolloutEngine` Protocol): ``add_request``, ``step() -> list[GenerationChunk]``, ``abort(ids |
None)`` returning the partials, ``has_unfinished``, ``num_running``, ``num_waiting``,
``set_temperature``, ``update_weights(version, named_tensors)``, ``score_logprobs`` (the
weight-sync probe), ``version``, ``health()`` and ``close()``. Each is built from the job's config
by its ``from_config(cfg, model_dir, index, version, *, api_token=None)``:

- ``builtin``: `slime.engines.builtin.BuiltinEngine`, continuous batching in torch (the reference);
- ``vllm``: `slime.engines.vllm.VllmEngine`, vLLM's ``LLMEngine`` in this process;
- ``sglang``: `slime.engines.sglang.adapter.SglangEngine`, SGLang servers (launched or attached) over HTTP.

A new engine: a class with those methods and ``from_config``, one more branch in `make_engine`,
and a value of ``rollout.engine`` in `slime.config`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from slime.config import JobConfig
from slime.engines.contract import GenerationRequest, RolloutEngine


def make_engine(
    cfg: JobConfig, model_dir: str, index: int, version: int, *, api_token: str | None = None
) -> RolloutEngine:
    """Rollout worker ``index``'s engine, at policy ``version``. ``api_token``: the job's token for
    the SGLang engine's servers and router (sent on every request, handed to launched ones in their
    environment); the in-process engines ignore it."""
    # Late imports: this package's __init__ runs in every process that starts one of its modules,
    # `python -m slime.engines.sglang.launch router` (sglang-router) among them, which must not
    # load torch and transformers (~2.5 s and ~250 MB per process); and vLLM's adapter is
    # imported only by jobs that choose it.
    kind = cfg.rollout.engine
    if kind == "builtin":
        from slime.engines.builtin import BuiltinEngine as engine_class
    elif kind == "vllm":
        from slime.engines.vllm import VllmEngine as engine_class
    elif kind == "sglang":
        from slime.engines.sglang.adapter import SglangEngine as engine_class
    else:
        raise ValueError(f"rollout.engine={kind!r} is not available")
    return engine_class.from_config(cfg, model_dir, index, version, api_token=api_token)


def run_to_completion(engine: RolloutEngine, requests: Sequence[GenerationRequest]) -> dict[str, dict[str, Any]]:
    """Every request on `engine` until each finishes: request id -> {"token_ids", "logprobs",
    "finish_reason"} (held-out evaluation, the off-policy controller's gap probe; the engine runs
    nothing else meanwhile)."""
    out: dict[str, dict[str, Any]] = {
        r.request_id: {"token_ids": [], "logprobs": [], "finish_reason": None} for r in requests
    }
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        for chunk in engine.step():
            answer = out[chunk.request_id]
            answer["token_ids"].extend(chunk.token_ids)
            answer["logprobs"].extend(chunk.logprobs)
            if chunk.finished:
                answer["finish_reason"] = chunk.finish_reason
    return out
