"""Resuming a run whose model settings changed since its checkpoint was written."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from transformers import AutoTokenizer

from slime.buffer import TrajectoryStore
from slime.config import TinyModelConfig, load_config
from slime.export import ExportError, checkpoints_of, export_checkpoint
from slime.learner import Learner
from slime.learner.sharding import CheckpointError
from slime.model import build_tiny_moe
from slime.train import train
from tests.helpers import TINY_JOB


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


def _model_of_another_shape(tiny_model_dir, out):
    """The tiny MoE's tokenizer with a model of another hidden size: another base a run may name."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    build_tiny_moe(TinyModelConfig(hidden_size=64), len(tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_the_checkpoint_keeps_the_config_that_trained_it(tiny_model_dir, tmp_path, capsys):
    """A resume with another model.path failed, but had already rewritten config.yaml first; export
    then paired the trained weights with that other model's tokenizer and config, silently."""
    run, other = tmp_path / "run", _model_of_another_shape(tiny_model_dir, tmp_path / "other")
    base = [*TINY_JOB, "cluster.launcher=local", f"output_dir={run}", f"model.path={tiny_model_dir}"]
    train(load_config(None, [*base, "steps=1", "job_name=kept-config"]))
    (checkpoint,) = checkpoints_of(run)
    assert yaml.safe_load((checkpoint / "config.yaml").read_text())["model"]["path"] == str(tiny_model_dir)
    before = (run / "config.yaml").read_text()
    with pytest.raises(CheckpointError, match="another shape"):
        train(load_config(None, [*base, "steps=2", "resume=auto", f"model.path={other}", "job_name=kept-config"]))
    assert (run / "config.yaml").read_text() == before  # the refused resume left it as it was

    capsys.readouterr()
    train(load_config(None, [*base, "steps=2", "resume=auto", "learner.lr=0.0003", "job_name=kept-config"]))
    said = capsys.readouterr().out
    assert re.search(r"resume: 1 settings differ from step_000001's: learner.lr: [0-9.e-]+ -> 0.0003", said), said
    assert yaml.safe_load((run / "config.yaml").read_text())["learner"]["lr"] == 0.0003
    assert yaml.safe_load((checkpoint / "config.yaml").read_text())["learner"]["lr"] != 0.0003

    # The run's config.yaml names another base now (as a hand edit would): export reads the checkpoint's.
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["path"] = str(other)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    info = json.loads((export_checkpoint(checkpoint, tmp_path / "export") / "slime_export.json").read_text())
    assert info["base_model"] == str(tiny_model_dir)
    # An older checkpoint without its own copy: a base of another shape is refused, not exported.
    (checkpoint / "config.yaml").unlink()
    with pytest.raises(ExportError, match="its policy has hidden_size=.* but the base model .* has 64"):
        export_checkpoint(checkpoint, tmp_path / "export2")
