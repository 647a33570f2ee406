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


def make_engine(cfg: JobConfig, model_dir: str, index: int, version: int):
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
        )
    raise ValueError(f"rollout.engine={kind!r} is not available")
