"""What a user coming from verl, slime, OpenRLHF or TRL brings: a chat model directory whose turn
ends at an id listed only in generation_config.json, verl's parquet rows, their reward functions."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from slime.config import RolloutConfig
from slime.model import load_tokenizer, rollout_sampling_params

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
CHAT = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def llama3_style_dir(path: Path, generation_eos: object = (1, 2)) -> Path:
    """A tokenizer directory like Llama 3 Instruct's: eos_token <|end_of_text|> (1), the chat turn's
    end <|eot_id|> (2) listed in generation_config.json's eos_token_id, no pad token."""
    vocab = {t: i for i, t in enumerate(SPECIAL + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[1], additional_special_tokens=SPECIAL[2:]
    )
    hf.chat_template = CHAT
    hf.save_pretrained(path)
    eos = list(generation_eos) if isinstance(generation_eos, tuple) else generation_eos
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": eos}))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 1}))
    return path


def test_the_rollout_stops_at_every_eos_id_of_generation_config(tmp_path):
    tokenizer = load_tokenizer(llama3_style_dir(tmp_path))
    assert tokenizer.eos_token_id == 1
    params = rollout_sampling_params(RolloutConfig(), tokenizer)
    assert params.stop_token_ids == [1, 2]  # <|eot_id|> ends the assistant's turn, as HF generate stops
    assert rollout_sampling_params(RolloutConfig(stop=["<|eot_id|>"]), tokenizer).stop_token_ids == [1, 2]


def test_a_single_generation_eos_or_none_keeps_the_tokenizers(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert rollout_sampling_params(
        RolloutConfig(), load_tokenizer(llama3_style_dir(tmp_path / "a", 2))
    ).stop_token_ids == [1, 2]
    tokenizer = load_tokenizer(llama3_style_dir(tmp_path / "b", None))  # none there: config.json's
    assert rollout_sampling_params(RolloutConfig(), tokenizer).stop_token_ids == [1]


def verl_row_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl reward as written for verl's rows: extra_info is the row's extra_info column."""
    assert extra_info["split"] == "train" and extra_info["index"] == 7
    return float(solution_str.strip() == ground_truth)


def test_a_verl_reward_reads_verl_rows_as_verl_does():
    from rewards.adapters import adapt

    row_meta = {  # a verl parquet row's columns other than the prompt, as the reward gets them
        "data_source": "openai/gsm8k",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"split": "train", "index": 7},
        "prompt_text": "What is 2+3?",
    }
    fn = adapt(verl_row_score)
    assert fn("What is 2+3?", " 5", None, row_meta) == 1.0  # ground truth from reward_model, not None
    assert fn("What is 2+3?", "6", None, row_meta) == 0.0
    assert fn("What is 2+3?", "6", "6", row_meta) == 1.0  # data.label_key's label comes first


def test_a_dotted_label_key_reads_verls_nested_ground_truth(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from slime.config import DataConfig
    from slime.data import load_prompts

    tokenizer = load_tokenizer(llama3_style_dir(tmp_path))
    rows = [
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}],
            "reward_model": {"style": "rule", "ground_truth": str(i)},
        }
        for i in range(2)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    cfg = DataConfig(path=str(tmp_path / "train.parquet"), label_key="reward_model.ground_truth")
    records = load_prompts(cfg, tokenizer)
    assert [r.label for r in records] == ["0", "1"]
    assert records[0].metadata["reward_model"] == {"style": "rule", "ground_truth": "0"}
    text = tokenizer.decode(records[0].prompt_ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system") and text.endswith(
        "assistant<|end_header_id|>\n\n"
    )


def trl_conversational_accuracy(completions, ground_truth, **kwargs):
    """As TRL's docs write a reward for a conversational dataset."""
    assert kwargs["prompts"][0][-1] == {"role": "user", "content": "2+3?"}
    return [float(c[0]["content"].strip() == g) for c, g in zip(completions, ground_truth)]


def test_a_trl_reward_gets_a_chat_datasets_prompts_and_completions_as_messages():
    from rewards.adapters import adapt
    from slime.data import PromptRecord, reward_metadata

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    meta = reward_metadata(PromptRecord(0, messages, [1, 2], "5", {}))
    fn = adapt(trl_conversational_accuracy)
    assert fn(meta["prompt_text"], " 5", "5", meta) == 1.0
    assert fn(meta["prompt_text"], "6", "5", meta) == 0.0
    text_meta = reward_metadata(PromptRecord(0, "2+3?", [1, 2], "5", {}))  # a text prompt: plain strings
    assert "prompt_messages" not in text_meta
    assert adapt(lambda completions, **kw: [float(completions[0] == "5")])("2+3?", "5", "5", text_meta) == 1.0


def test_a_chat_template_that_refuses_the_messages_names_the_row(tmp_path):
    import pytest

    from slime.config import DataConfig
    from slime.data import DatasetError, load_prompts

    tokenizer = load_tokenizer(llama3_style_dir(tmp_path))
    tokenizer.chat_template = (  # as Gemma's: no system role
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + CHAT
    )
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": [{"role": "system", "content": "x"}]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        DatasetError, match=r"chat\.jsonl:2: the tokenizer's chat template refused .*System role not supported"
    ):
        load_prompts(DataConfig(path=str(path)), tokenizer)


def test_a_chat_template_with_a_syntax_error_is_named_in_the_model_dir_not_the_data(tmp_path):
    """A template Jinja cannot parse is the model directory's fault: named there, with its line,
    never as a dataset line's messages (the hint of which was to change the data)."""
    import pytest

    from slime.config import DataConfig
    from slime.data import ChatTemplateError, DatasetError, load_prompts

    bad = "{% for m in messages %}\n{{ m.content }"
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "label": "x"}) + "\n")
    for holder in ("chat_template.jinja", "tokenizer_config.json"):
        model_dir = llama3_style_dir(tmp_path / holder.split(".")[0])
        if holder == "chat_template.jinja":
            (model_dir / holder).write_text(bad)
        else:  # an older model directory: the template inside tokenizer_config.json
            (model_dir / "chat_template.jinja").unlink()
            config = json.loads((model_dir / holder).read_text())
            (model_dir / holder).write_text(json.dumps({**config, "chat_template": bad}))
        with pytest.raises(ChatTemplateError) as caught:
            load_prompts(DataConfig(path=str(data)), load_tokenizer(model_dir))
        assert (
            str(caught.value) == f"{model_dir / holder}: the chat template is not valid Jinja, line 2: unexpected '}}'"
        )
        assert not isinstance(caught.value, DatasetError) and "the data is not at fault" in caught.value.hint


def test_the_reward_cache_keeps_rows_apart_whose_answer_is_in_another_column():
    from rewards.adapters import adapt
    from rewards.runner import RewardRunner
    from rewards.service import CachedRewards

    def accuracy(completions, solution, **kwargs):  # TRL: the answer in the dataset's `solution` column
        return [float(c == s) for c, s in zip(completions, solution)]

    cache = CachedRewards(RewardRunner(adapt(accuracy), 5, 2), max_entries=16)
    same_prompt = "Solve the attached problem."
    assert cache.submit(same_prompt, "5", None, {"solution": "5", "record_index": 0}).result(timeout=10).reward == 1.0
    assert cache.submit(same_prompt, "5", None, {"solution": "6", "record_index": 1}).result(timeout=10).reward == 0.0
    assert cache.submit(same_prompt, "5", None, {"solution": "5", "record_index": 0}).result(timeout=10).reward == 1.0
    assert cache.hits == 1  # a group's repeated response still hits
    cache.close()


def test_a_verl_rewards_extra_keys_reach_the_step_metrics(tiny_model_dir, tmp_path):
    """verl logs the other keys of compute_score's dict; here each sample keeps them as reward_info
    and the step's metrics carry the mean of each number (bools as 0/1), strings left out."""
    from slime.config import load_config
    from slime.train import train
    from tests.helpers import TINY_JOB

    (tmp_path / "verl_rm.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.5, 'acc': len(solution_str) % 2 == 0, 'length': len(solution_str), 'pred': 'x'}\n"
    )
    cfg = load_config(
        None,
        [
            "cluster.launcher=local",
            f"output_dir={tmp_path / 'run'}",
            f"model.path={tiny_model_dir}",
            *TINY_JOB,
            "steps=1",
            f"reward.fn={tmp_path / 'verl_rm.py'}:compute_score",
        ],
    )
    (step,) = train(cfg)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    logged = json.loads(lines[-1])
    info = {k: v for k, v in logged.items() if k.startswith("reward_info/")}
    assert set(info) == {"reward_info/acc", "reward_info/length"}, sorted(logged)
    assert 0 <= info["reward_info/acc"] <= 1 and info["reward_info/length"] > 0
    assert step["reward_mean"] == 0.5


def test_a_tokenizer_without_eos_and_no_stop_is_said_at_start(tmp_path, caplog):
    """Every response ran to max_new_tokens without a word: a base model's tokenizer, or one whose
    chat template ends a turn with a token that is not its EOS."""
    from slime.model import checked_rollout_stops

    model_dir = llama3_style_dir(tmp_path, None)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no eos_token_id anywhere
    tokenizer = load_tokenizer(model_dir)
    tokenizer.eos_token = None
    assert checked_rollout_stops(RolloutConfig(), tokenizer, str(tmp_path)) == []
    assert "has no EOS token and rollout.stop is empty" in caplog.text
    caplog.clear()
    assert checked_rollout_stops(RolloutConfig(stop=["<|eot_id|>"]), tokenizer, str(tmp_path)) == [2]
    assert checked_rollout_stops(RolloutConfig(ignore_eos=True), tokenizer, str(tmp_path)) == []
    assert "EOS" not in caplog.text


def test_a_chat_turn_end_that_is_no_stop_token_is_said_at_start(tmp_path, caplog):
    """A Qwen-base-style directory: EOS <|endoftext|>, the chat template ends a turn with <|im_end|>:
    every chat response ran past its turn to the budget, and the job said nothing. Text prompts
    (no chat template applied) are not warned about: a base model never writes the turn's end."""
    from types import SimpleNamespace

    from slime.config import load_config
    from slime.model import chat_turn_end, warn_unstopped_turn_end

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    base_like = load_tokenizer(llama3_style_dir(tmp_path / "a", None))  # <|eot_id|> is not in generation_config
    assert chat_turn_end(base_like) == 2
    chat_rows = [SimpleNamespace(prompt=[{"role": "user", "content": "hi"}])]
    text_rows = [SimpleNamespace(prompt="hi")]
    warn_unstopped_turn_end(base_like, load_config(None, []), text_rows, str(tmp_path / "a"))
    assert "assistant turn" not in caplog.text
    warn_unstopped_turn_end(base_like, load_config(None, []), chat_rows, str(tmp_path / "a"))
    assert "ends an assistant turn with '<|eot_id|>' (id 2), which is no stop token" in caplog.text
    assert "rollout.stop=['<|eot_id|>']" in caplog.text
    caplog.clear()
    warn_unstopped_turn_end(base_like, load_config(None, ["data.apply_chat_template=true"]), text_rows, "a")
    assert "assistant turn" in caplog.text
    caplog.clear()
    warn_unstopped_turn_end(base_like, load_config(None, ["rollout.stop=['<|eot_id|>']"]), chat_rows, "a")
    instruct = load_tokenizer(llama3_style_dir(tmp_path / "b"))  # generation_config lists both
    warn_unstopped_turn_end(instruct, load_config(None, []), chat_rows, str(tmp_path / "b"))
    assert "assistant turn" not in caplog.text
