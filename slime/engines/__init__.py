"""Rollout engines behind one contract, chosen by ``rollout.engine``.

Every engine offers what the rollout worker drives from its one generation thread:
``add_request``, ``step() -> list[GenerationChunk]``, ``abort(ids | None)`` returning the
partials, ``has_unfinished``, ``num_running``, ``num_waiting``, ``set_temperature``,
``update_weights(version, named_tensors)``, ``score_logprobs`` (the weight-sync probe),
``version`` and ``health()``. The built-in torch engine (`slime.engine.RolloutEngine`) is the
reference implementation.
"""

from __future__ import annotations

from slime.config import JobConfig


def make_engine(cfg: JobConfig, model_dir: str, index: int, version: int, *, api_token: str | None = None):
    """``api_token``: the job's token for the SGLang engine's servers and router (sent on every
    request, handed to launched ones in their environment); the in-process engines need none."""
    from slime.engine import RolloutEngine
    from slime.model import load_model

    kind = cfg.rollout.engine
    if kind == "builtin":
        model = load_model(model_dir, cfg.model.dtype, cfg.rollout.device)
        return RolloutEngine(
            model,
            device=cfg.rollout.device,
            max_running_requests=cfg.rollout.max_running_requests,
            seed=cfg.seed + 1000 * index,  # reproducible across runs (worker_id carries a run nonce)
            version=version,
            kept_kv_tokens=cfg.rollout.kept_kv_tokens,
        )
    if kind == "vllm":
        from slime.engines.vllm import VllmEngine

        v = cfg.vllm
        return VllmEngine(
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
        )
    if kind == "sglang":
        from slime.engines.sglang import SglangEngine

        return SglangEngine.from_config(cfg, model_dir, index, version, api_token=api_token)
    raise ValueError(f"rollout.engine={kind!r} is not available")
