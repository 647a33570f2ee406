"""Messages a user meets on a mistake (or on nothing wrong): each names the cause and what to type
instead, and none warns about what works. The CLI side (exit 2, one line) is in test_cli_errors.py."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from slime.config import ConfigError, DataConfig, ModelConfig, load_config, parse_override
from slime.data import load_prompts, write_jsonl

try:
    from tests.helpers import make_char_tokenizer
except ImportError:  # run from inside tests/
    from helpers import make_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "repeat_grpo.yaml"


# --- model.path ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "cause"),
    [
        (None, "no such directory"),
        ("", "no config.json there"),
        ("{not json", "is not readable JSON"),
        ("[1, 2]", "is not a JSON object"),
        ({"hidden_size": 8}, "has no model_type"),
        ({"model_type": "no_such_arch"}, "model_type 'no_such_arch'"),
    ],
)
def test_a_model_path_transformers_cannot_load_is_a_user_error(tmp_path, config, cause):
    from slime.errors import UserError
    from slime.model import ensure_model_dir

    model = tmp_path / "model"
    if config is not None:
        model.mkdir()
        if config != "":
            (model / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(UserError) as caught:
        ensure_model_dir(ModelConfig(path=str(model)))
    message = str(caught.value)
    assert message.startswith(f"model.path={model}: ") and cause in message and "\n" not in message
    assert isinstance(caught.value, FileNotFoundError if config in (None, "") else ValueError)


def test_a_model_path_transformers_loads_passes(tmp_path):
    from slime.model import ensure_model_dir

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert ensure_model_dir(ModelConfig(path=str(tmp_path))) == tmp_path


@pytest.mark.parametrize(
    ("files", "cause"),
    [
        (["tokenizer.json", "tokenizer_config.json"], "no weights in"),
        (["model-00001-of-00002.safetensors", "special_tokens_map.json"], "no tokenizer in"),
    ],
)
def test_a_model_dir_without_weights_or_tokenizer_is_refused_at_start(tmp_path, files, cause):
    """Without weights every actor's load would fail (under Ray: restarts over the same mistake);
    without a tokenizer transformers 5 builds an empty one and the job trains on unknown tokens."""
    from slime.model import ModelDirError, ensure_model_dir

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for name in files:
        (tmp_path / name).write_text("")
    with pytest.raises(
        ModelDirError, match=f"^model.path={re.escape(str(tmp_path))}: {cause} {re.escape(str(tmp_path))}"
    ):
        ensure_model_dir(ModelConfig(path=str(tmp_path)))


def test_weights_that_do_not_fit_the_config_are_refused_not_initialized_at_random(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from slime.model import ModelDirError, load_model

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert load_model(tmp_path).config.num_hidden_layers == 1
    bigger = json.loads((tmp_path / "config.json").read_text()) | {"num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(bigger))
    with pytest.raises(ModelDirError, match=r"do not fit its config.json \(LlamaForCausalLM\): 9 of the model's"):
        load_model(tmp_path)


# --- algorithm.loss_agg ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "default", "other"),
    [("gspo", "seq_mean_token_mean", "seq_mean_token_sum"), ("dr_grpo", "seq_mean_token_sum", "seq_mean_token_mean")],
)
def test_a_sequence_mean_algorithm_names_the_loss_agg_values_it_takes(name, default, other):
    with pytest.raises(ConfigError) as caught:
        load_config(EXAMPLE, [f"algorithm.name={name}", "algorithm.loss_agg=token_mean"])
    assert f"set algorithm.loss_agg={default} (its default when unset) or algorithm.loss_agg={other}" in str(
        caught.value
    )
    for value in (default, other):  # both values it names are taken
        assert (
            load_config(EXAMPLE, [f"algorithm.name={name}", f"algorithm.loss_agg={value}"]).algorithm.loss_agg == value
        )


# --- overrides that are not YAML -----------------------------------------------------------------


def test_an_override_that_is_not_yaml_says_to_quote_it():
    with pytest.raises(ConfigError) as caught:
        parse_override("data.input_template=Question: {}\\nAnswer:")
    message = str(caught.value)
    assert "value is not valid YAML" in message and "\n" not in message
    assert "quote the value, e.g. 'data.input_template=\"...\"'" in message


def test_the_readme_input_template_example_types_as_given():
    """The README's command-line form of data.input_template parses, and its \\n is a newline."""
    readme = (ROOT / "README.md").read_text()
    examples = re.findall(r"`'(data\.input_template=[^`]*)'`", readme)
    assert examples, "the README shows data.input_template on a command line"
    for text in examples:
        path, value = parse_override(text)
        assert path == ["data", "input_template"] and "{}" in value and "\n" in value


# --- the dataset's label column -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "warns"),
    [
        ({"prompt": "1+1?", "reward_model": {"style": "rule", "ground_truth": "2"}}, False),  # verl's parquet rows
        ({"prompt": "1+1?", "solution": "2"}, False),  # TRL's
        ({"prompt": "1+1?", "ground_truth": "2"}, False),
        ({"prompt": "1+1?", "answer": "2"}, True),  # gsm8k: data.label_key=answer is needed
        ({"prompt": "1+1?"}, True),
    ],
)
def test_the_missing_label_warning_only_where_no_answer_column_is(tmp_path, caplog, row, warns):
    path = write_jsonl([row], tmp_path / "d.jsonl")
    with caplog.at_level("WARNING", logger="slime.data"):
        load_prompts(DataConfig(), make_char_tokenizer(), str(path))
    assert ("no row has the label column 'label'" in caplog.text) == warns, caplog.text


# --- rule rewards -----------------------------------------------------------------------------------


def test_math_answer_does_not_warn_that_its_timeout_is_off(caplog, monkeypatch):
    parser = pytest.importorskip("math_verify.parser")
    grader = pytest.importorskip("math_verify.grader")
    from rewards.rule import math_answer

    monkeypatch.setattr(parser, "TIMEOUT_WARNING_SHOWN", False)  # math-verify warns once per process
    monkeypatch.setattr(grader, "TIMEOUT_WARNING_SHOWN", False)
    with caplog.at_level(logging.WARNING):
        assert math_answer("", "so the answer is \\boxed{2}", "2") == 1.0
        logging.getLogger("math_verify.parser").warning("another warning")
    assert "Timeout is disabled" not in caplog.text
    assert "another warning" in caplog.text  # its other warnings still show


# --- slime eval on a LoRA export, slime simulate's presets -----------------------------------------


def test_eval_of_a_lora_adapter_export_says_to_merge_it_first(tmp_path):
    from slime.evaluation import EvalError, _job_config

    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "slime_export.json").write_text(json.dumps({"checkpoint": "/runs/a/checkpoints/step_4"}))
    with pytest.raises(EvalError) as caught:
        _job_config(tmp_path, [])
    message = str(caught.value)
    assert "a LoRA adapter export" in message
    assert "`slime export /runs/a/checkpoints/step_4 --out DIR --merged`" in message


def test_simulate_help_names_every_preset(capsys):
    from april.sim import PRESETS
    from slime.tools.simulate import ARGS_HELP, main_simulate

    assert "paper_runs" in PRESETS
    assert main_simulate(["--help"]) == 0
    shown = capsys.readouterr().out
    for name in PRESETS:
        assert name in ARGS_HELP and name in shown
