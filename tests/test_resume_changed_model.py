"""Resuming a run whose model settings changed since its checkpoint was written."""

from __future__ import annotations

import pytest

from slime.buffer import TrajectoryStore
from slime.config import TinyModelConfig, load_config
from slime.learner import Learner
from slime.learner.sharding import CheckpointError
from slime.model import build_tiny_moe


def test_resume_into_a_model_of_another_shape_names_the_cause(tiny_model_dir, redis_url, tmp_path):
    # `resume=auto model.tiny.hidden_size=64` on a run of the default tiny MoE died with torch's
    # RuntimeError listing every tensor (a raw traceback, exit 1); now one CheckpointError line,
    # which the CLI prints with exit 2.
    job = "learner-ckpt-shape"
    cfg = load_config(None, [f"job_name={job}", f"output_dir={tmp_path}"])
    learner = Learner(cfg, str(tiny_model_dir), redis_url)
    learner.save(str(tmp_path / "ckpt"))
    vocab = learner.policy.get_input_embeddings().weight.shape[0]
    build_tiny_moe(TinyModelConfig(hidden_size=64), vocab).save_pretrained(tmp_path / "ckpt" / "policy")
    with pytest.raises(CheckpointError, match="another shape.*size mismatch for model.embed_tokens.weight"):
        Learner(cfg, str(tiny_model_dir), redis_url).load(str(tmp_path / "ckpt"))
    TrajectoryStore.open(redis_url, job).delete_job()
