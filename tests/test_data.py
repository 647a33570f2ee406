from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slime.config import DataConfig
from slime.data import DatasetError, OverlongPrompt, PromptRecord, load_prompts, reward_metadata, write_jsonl

try:
    from tests.helpers import make_char_tokenizer
except ImportError:  # tests/ itself on sys.path
    from helpers import make_char_tokenizer

TEXT_ROWS = [
    {"prompt": "add 1 2", "label": "3", "task": "math", "source": "gen"},
    {"prompt": "no label here", "label": None, "task": "math", "source": "web"},
]
# A column holds one type in Arrow, so chat prompts are their own dataset.
CHAT_ROWS = [
    {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "label": "hello",
        "task": "chat",
    },
]


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def save_all_formats(rows: list[dict], d: Path) -> list[Path]:
    d.mkdir()
    paths = [write_jsonl(rows, d / "d.jsonl"), d / "d.parquet", d / "hf", d / "hfdict"]
    pq.write_table(pa.Table.from_pylist(rows), d / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(d / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(d / "hfdict"))
    return paths


@pytest.mark.parametrize("rows", [TEXT_ROWS, CHAT_ROWS], ids=["text", "chat"])
def test_jsonl_parquet_and_hf_dir_give_the_same_records(tmp_path: Path, tok, rows: list[dict]) -> None:
    first, *others = save_all_formats(rows, tmp_path / "data")
    expected = load_prompts(DataConfig(), tok, str(first))
    assert len(expected) == len(rows)
    for path in others:
        assert load_prompts(DataConfig(), tok, str(path)) == expected, path


def test_text_records(tmp_path: Path, tok) -> None:
    labeled, unlabeled = load_prompts(DataConfig(), tok, str(write_jsonl(TEXT_ROWS, tmp_path / "d.jsonl")))
    assert labeled == PromptRecord(0, "add 1 2", ids(tok, "add 1 2"), "3", {"task": "math", "source": "gen"})
    assert unlabeled.label is None and unlabeled.index == 1


def test_chat_records_get_the_template(tmp_path: Path, tok) -> None:
    (chat,) = load_prompts(DataConfig(), tok, str(write_jsonl(CHAT_ROWS, tmp_path / "d.jsonl")))
    assert chat.prompt == CHAT_ROWS[0]["prompt"]
    assert tok.decode(chat.prompt_ids) == "<|system|>be brief<|user|>hi<|assistant|>"
    assert chat.label == "hello" and chat.metadata == {"task": "chat"}
    # chat messages reach the model only through the template: an explicit false is refused, not ignored
    with pytest.raises(
        DatasetError, match=r"d.jsonl:1: the prompt \('prompt'\) is chat messages.*apply_chat_template=false"
    ):
        load_prompts(DataConfig(apply_chat_template=False), tok, str(tmp_path / "d.jsonl"))
    (templated,) = load_prompts(DataConfig(apply_chat_template=True), tok, str(tmp_path / "d.jsonl"))
    assert templated.prompt_ids == chat.prompt_ids


def test_cfg_path_keys_and_chat_template_flag(tmp_path: Path, tok) -> None:
    path = write_jsonl([{"q": "2+2", "answer": 4, "kind": "arith", "id": 7}], tmp_path / "x.json")
    cfg = DataConfig(path=str(path), prompt_key="q", label_key="answer", task_key="kind", apply_chat_template=True)
    (rec,) = load_prompts(cfg, tok)
    assert tok.decode(rec.prompt_ids) == "<|user|>2+2<|assistant|>"
    assert rec.label == 4
    assert rec.metadata == {"kind": "arith", "id": 7, "task": "arith"}


def test_a_system_prompt_goes_before_what_the_template_renders(tmp_path: Path, tok) -> None:
    text = write_jsonl([{"prompt": "2+2"}], tmp_path / "text.jsonl")
    (rec,) = load_prompts(DataConfig(apply_chat_template=True, system_prompt="be brief"), tok, str(text))
    assert tok.decode(rec.prompt_ids) == "<|system|>be brief<|user|>2+2<|assistant|>"
    assert rec.prompt == "2+2"  # the reward still gets the row's prompt
    chats = [{"prompt": [{"role": "user", "content": "hi"}], "label": None}, CHAT_ROWS[0]]
    plain, own = load_prompts(DataConfig(system_prompt="be kind"), tok, str(write_jsonl(chats, tmp_path / "c.jsonl")))
    assert tok.decode(plain.prompt_ids) == "<|system|>be kind<|user|>hi<|assistant|>"
    assert plain.prompt[0] == {"role": "system", "content": "be kind"}  # as a reward given the messages sees it
    assert tok.decode(own.prompt_ids) == "<|system|>be brief<|user|>hi<|assistant|>"  # the row's own system wins
    # a text row stays TRL's standard format (TRL decides by the dataset's prompts, not the template)
    assert "prompt_messages" not in reward_metadata(rec)
    with pytest.raises(DatasetError, match="data.system_prompt cannot reach the model: set data.apply_chat_template"):
        load_prompts(DataConfig(system_prompt="be brief"), tok, str(text))
    with pytest.raises(ValueError, match="data.system_prompt goes through the chat template"):
        DataConfig(system_prompt="x", input_template="Q: {}")


def test_blank_lines_are_skipped(tmp_path: Path, tok) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('\n{"prompt": "a"}\n   \n{"prompt": "b"}\n\n')
    assert [r.prompt for r in load_prompts(DataConfig(), tok, str(path))] == ["a", "b"]


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_bad_json_names_file_and_line(tmp_path: Path, tok) -> None:
    path = write_lines(tmp_path / "file.jsonl", ['{"prompt": "a"}', '{"prompt": "b"}', '{"prompt": "c",'])
    with pytest.raises(DatasetError, match=r"file\.jsonl:3: malformed JSON"):
        load_prompts(DataConfig(), tok, path)


@pytest.mark.parametrize(
    "row, cause",
    [
        ({"text": "a"}, r"d\.jsonl:2: missing the prompt column 'prompt' .*\['text'\]"),
        ({"prompt": 5}, r"d\.jsonl:2: the prompt \('prompt'\) must be a string or a list .* got int"),
        ({"prompt": "   "}, r"d\.jsonl:2: the prompt \('prompt'\) is empty"),
        ({"prompt": []}, r"d\.jsonl:2: .*empty list of messages"),
        ({"prompt": ["hi"]}, r"d\.jsonl:2: chat message 0 .* got str"),
        ({"prompt": [{"role": "user"}]}, r"d\.jsonl:2: chat message 0 .*'content' must be a string, got missing"),
        ({"prompt": [{"role": "user", "content": ""}]}, r"d\.jsonl:2: .*chat messages whose contents are all empty"),
        (
            {"prompt": [{"role": "system", "content": " "}, {"role": "user", "content": "  \n"}]},
            r"d\.jsonl:2: the prompt \('prompt'\) is chat messages whose contents are all empty",
        ),
        ({"prompt": "x" * 20}, r"d\.jsonl:2: the prompt has 20 tokens, more than data\.max_prompt_tokens=10"),
    ],
)
def test_bad_rows(tmp_path: Path, tok, row: dict, cause: str) -> None:
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "ok"}), json.dumps(row)])
    with pytest.raises(DatasetError, match=cause):
        load_prompts(DataConfig(max_prompt_tokens=10), tok, path)


def test_overlong_prompts_can_be_dropped_with_a_count(tmp_path: Path, tok, caplog) -> None:
    """data.overlong_prompts=drop (verl's filter_overlong_prompts): the rows over the budget are
    skipped and counted, the rest indexed 0.. in order; all of them over it is still an error."""
    rows = [{"prompt": "ok", "label": "a"}, {"prompt": "x" * 20}, {"prompt": "fine", "label": "b"}]
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    with caplog.at_level("WARNING"):
        records = load_prompts(DataConfig(max_prompt_tokens=10, overlong_prompts="drop"), tok, path)
    assert [(r.index, r.label) for r in records] == [(0, "a"), (1, "b")]
    assert "dropped 1 of 3 prompts over data.max_prompt_tokens=10" in caplog.text and "d.jsonl:2" in caplog.text
    only_long = write_lines(tmp_path / "long.jsonl", [json.dumps({"prompt": "y" * 30})])
    with pytest.raises(
        DatasetError,
        match=r"every prompt \(1\) is over data.max_prompt_tokens=10 \(data.overlong_prompts=drop dropped them all\)",
    ):
        load_prompts(DataConfig(max_prompt_tokens=10, overlong_prompts="drop"), tok, only_long)


def test_an_input_template_shapes_what_the_model_reads_not_what_the_reward_gets(tmp_path: Path, tok) -> None:
    """data.input_template (OpenRLHF's --input_template): the prompt's tokens are the template's
    with the row's prompt in place of {}; the record (the reward's prompt) keeps the row's."""
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "ab*2="})])
    (record,) = load_prompts(DataConfig(input_template="Q: {} A:"), tok, path)
    assert record.prompt == "ab*2="
    assert record.prompt_ids == list(tok("Q: ab*2= A:", add_special_tokens=False)["input_ids"])
    for bad, cause in [("no slot", "must hold {} once"), ("{} {}", "must hold {} once")]:
        with pytest.raises(ValueError, match=re.escape(cause)):
            DataConfig(input_template=bad)
    with pytest.raises(ValueError, match="choose one"):
        DataConfig(input_template="{}", apply_chat_template=True)
    chat = write_lines(tmp_path / "c.jsonl", [json.dumps({"prompt": [{"role": "user", "content": "hi"}]})])
    with pytest.raises(
        DatasetError, match=r"c\.jsonl:1: the prompt \('prompt'\) is chat messages.*unset data.input_template"
    ):
        load_prompts(DataConfig(input_template="Q: {} A:"), tok, chat)


def test_bad_parquet_row_names_the_row(tmp_path: Path, tok) -> None:
    pq.write_table(pa.Table.from_pylist([{"prompt": "ok"}, {"prompt": ""}]), tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"d\.parquet:row 1: the prompt \('prompt'\) is empty"):
        load_prompts(DataConfig(), tok, str(tmp_path / "d.parquet"))


def test_a_column_json_cannot_hold_names_the_row_and_column(tmp_path: Path, tok) -> None:
    """Label and metadata travel to the buffer as JSON: a datetime column (common in real datasets)
    failed in the middle of the job, from inside the buffer."""
    import datetime

    rows = [
        {"prompt": "ok", "label": "a", "when": None},
        {"prompt": "ok", "label": "b", "when": datetime.datetime(2026, 1, 2)},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"d\.parquet:row 1: column 'when' holds datetime, which JSON cannot hold"):
        load_prompts(DataConfig(), tok, str(tmp_path / "d.parquet"))


def test_chat_messages_need_a_chat_template(tmp_path: Path) -> None:
    path = write_jsonl([{"prompt": [{"role": "user", "content": "hi"}]}], tmp_path / "d.jsonl")
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: .*has no chat_template"):
        load_prompts(DataConfig(), make_char_tokenizer(chat_template=None), str(path))


@pytest.mark.parametrize(
    "line, said",
    [
        (
            b'{"prompt": "ab*2=", "label": "ab\xff\xfe"}',
            r"bad\.jsonl:2: not UTF-8 text \(byte 0xff at byte 33 of the line\)",
        ),
        # valid JSON, but \udfff decodes to a lone surrogate: it stopped the job when the reward cached it
        (
            b'{"prompt": "ab*2=", "label": "ab\\udfffab"}',
            r"bad\.jsonl:2: a string holds \\udfff, a lone UTF-16 surrogate",
        ),
        (b'{"prompt": "a", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"bad\.jsonl:2: JSON nested too deeply"),
    ],
)
def test_a_line_that_is_not_text_or_too_deep_is_named_by_its_line(tmp_path: Path, tok, line: bytes, said: str) -> None:
    (tmp_path / "bad.jsonl").write_bytes(
        b'\xef\xbb\xbf{"prompt": "ab*2=", "label": "abab"}\n' + line + b"\n"
    )  # a BOM first
    with pytest.raises(DatasetError, match=said):
        load_prompts(DataConfig(), tok, str(tmp_path / "bad.jsonl"))


def test_whole_file_errors(tmp_path: Path, tok) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match=r"empty\.jsonl: the dataset has no rows"):
        load_prompts(DataConfig(), tok, str(tmp_path / "empty.jsonl"))

    (tmp_path / "d.csv").write_text("prompt\na\n")
    with pytest.raises(DatasetError, match=r"d\.csv: unsupported dataset format '\.csv'; supported: JSON Lines"):
        load_prompts(DataConfig(), tok, str(tmp_path / "d.csv"))

    with pytest.raises(DatasetError, match=r"dataset not found: .*nope\.jsonl"):
        load_prompts(DataConfig(), tok, str(tmp_path / "nope.jsonl"))

    with pytest.raises(DatasetError, match=r"no dataset path"):
        load_prompts(DataConfig(), tok)

    (tmp_path / "arr.json").write_text('[{"prompt": "a"},\n {"prompt": "b"}]\n')
    with pytest.raises(DatasetError, match=r"arr\.json:1: .*JSON array"):
        load_prompts(DataConfig(), tok, str(tmp_path / "arr.json"))

    (tmp_path / "notds").mkdir()
    with pytest.raises(DatasetError, match=r"notds: a directory, but not loadable"):
        load_prompts(DataConfig(), tok, str(tmp_path / "notds"))

    datasets.DatasetDict({"test": datasets.Dataset.from_list(TEXT_ROWS)}).save_to_disk(str(tmp_path / "nosplit"))
    with pytest.raises(DatasetError, match=r"without a 'train' split; its splits are \['test'\]"):
        load_prompts(DataConfig(), tok, str(tmp_path / "nosplit"))


def test_dataset_error_is_a_value_error() -> None:
    assert issubclass(DatasetError, ValueError)


def test_a_dataset_without_its_label_column_is_named_at_load(tmp_path: Path, tok, caplog) -> None:
    """gsm8k-style rows (`question`/`answer`) loaded with only data.prompt_key set have no `label`:
    a rule reward then fails every sample, so the load says why up front."""
    path = write_jsonl([{"question": "1+1?", "answer": "2"}], tmp_path / "d.jsonl")
    with caplog.at_level("WARNING", logger="slime.data"):
        load_prompts(DataConfig(prompt_key="question"), tok, str(path))
    assert "no row has the label column 'label' (data.label_key)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="slime.data"):
        load_prompts(DataConfig(prompt_key="question", label_key="answer"), tok, str(path))
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("row", "overrides", "cause"),
    [
        ({"prompt": "a", "response_ids": [1, 2]}, {}, "the column 'response_ids' has the name of a key the job writes"),
        ({"prompt": "a", "loss_masked": True}, {}, "'loss_masked' has the name of a key the job writes"),
        ({"prompt": "a", "model_response": "x"}, {}, "the response as the model wrote it"),
        ({"prompt": "a", "answer": "1", "label": "x"}, {"label_key": "answer"}, "set data.label_key=label"),
        ({"prompt": "a", "kind": "k", "task": "t"}, {"task_key": "kind"}, "the column 'task' would be hidden"),
    ],
)
def test_a_column_the_job_would_overwrite_is_refused_by_name(
    tmp_path: Path, tok, row: dict, overrides: dict, cause: str
) -> None:
    path = write_jsonl([{"prompt": "fine"}, row], tmp_path / "d.jsonl")
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(cause)):
        load_prompts(DataConfig(**overrides), tok, str(path))


def test_columns_beside_the_keys_the_job_writes_are_kept(tmp_path: Path, tok) -> None:
    path = write_jsonl([{"prompt": "a", "answer": "1", "kind": "k", "extra": 3}], tmp_path / "d.jsonl")
    (rec,) = load_prompts(DataConfig(label_key="answer", task_key="kind"), tok, str(path))
    assert rec.label == "1" and rec.metadata == {"kind": "k", "extra": 3, "task": "k"}
    # the label column under its default name, and a task column the task key does not find, are the row's own
    path = write_jsonl([{"prompt": "a", "label": "1", "task": "t"}], tmp_path / "e.jsonl")
    (rec,) = load_prompts(DataConfig(task_key="kind"), tok, str(path))
    assert rec.label == "1" and rec.metadata == {"task": "t"}


@pytest.mark.parametrize("label_key", ["answr", "reward_model.groundtruth"])
def test_a_label_key_no_row_has_is_refused_naming_the_columns(tmp_path: Path, tok, label_key: str) -> None:
    """A misspelled data.label_key gave every sample label None, silently where a verl column was
    beside it (that column hides the missing-label warning)."""
    row = {"prompt": "1+1?", "answer": "2", "reward_model": {"ground_truth": "2", "style": "rule"}}
    path = write_jsonl([row, row], tmp_path / "d.jsonl")
    columns = "['prompt', 'answer', 'reward_model', 'reward_model.ground_truth', 'reward_model.style']"
    with pytest.raises(
        DatasetError,
        match=re.escape(
            f"no row has the label column {label_key!r} (data.label_key); the first row's columns are {columns}"
        ),
    ):
        load_prompts(DataConfig(label_key=label_key), tok, str(path))
    for good in ("answer", "reward_model.ground_truth"):
        assert [r.label for r in load_prompts(DataConfig(label_key=good), tok, str(path))] == ["2", "2"]


@pytest.mark.parametrize(
    ("label_key", "labeled", "none"),
    [
        ("label", {"prompt": "b", "label": "2"}, {"label": None}),
        ("answer", {"prompt": "b", "answer": "2"}, {"answer": None}),
        (
            "reward_model.ground_truth",
            {"prompt": "b", "reward_model": {"ground_truth": "2"}},
            {"reward_model": {"ground_truth": None}},
        ),
    ],
)
def test_a_row_without_the_label_column_other_rows_have_is_refused_naming_it(
    tmp_path: Path, tok, label_key: str, labeled: dict, none: dict
) -> None:
    """A row that lost its label reached the reward as label=None, silently; like a row without its
    prompt, it is refused at load naming the file:line and the key. A row with no label says null."""
    unlabeled = {"prompt": "a", "task": "t"}
    path = write_jsonl([unlabeled, labeled, unlabeled], tmp_path / "d.jsonl")
    with pytest.raises(DatasetError) as caught:
        load_prompts(DataConfig(label_key=label_key), tok, str(path))
    assert str(caught.value) == (
        f"{path}:1: missing the label column {label_key!r} (data.label_key), which other rows have "
        "(2 of 3 rows lack it); the row has ['prompt', 'task']"
    )
    assert f"({label_key!r}: null)" in caught.value.hint
    path = write_jsonl([{**unlabeled, **none}, labeled], tmp_path / "e.jsonl")
    assert [r.label for r in load_prompts(DataConfig(label_key=label_key), tok, str(path))] == [None, "2"]


def test_an_empty_message_beside_others_is_fine(tmp_path: Path, tok) -> None:
    prompt = [
        {"role": "system", "content": ""},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": ""},
    ]
    (rec,) = load_prompts(DataConfig(), tok, str(write_jsonl([{"prompt": prompt}], tmp_path / "d.jsonl")))
    assert rec.prompt == prompt


def test_parquet_chat_messages_keep_only_the_keys_they_were_written_with(tmp_path: Path, tok) -> None:
    """Arrow gives every message of a column each field any message has: a message without `name`
    reached the template and the reward with name=None. Labels and metadata keep their nulls."""
    rows = [
        {"prompt": [{"role": "user", "content": "ab"}], "label": {"a": 1}, "extra": {"x": 1}},
        {"prompt": [{"role": "user", "content": "cd", "name": "bob"}], "label": {"a": None}, "extra": {"x": None}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    records = load_prompts(DataConfig(), tok, str(tmp_path / "d.parquet"))
    assert [r.prompt for r in records] == [row["prompt"] for row in rows]
    assert reward_metadata(records[0])["prompt_messages"] == [{"role": "user", "content": "ab"}]
    assert records == load_prompts(DataConfig(), tok, str(write_jsonl(rows, tmp_path / "d.jsonl")))
    assert [r.label for r in records] == [{"a": 1}, {"a": None}] and records[1].metadata == {"extra": {"x": None}}


class TokenizerSpy:
    """The tokenizer, noting the longest text it was asked to tokenize (a chat prompt: its contents)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, text: str, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tokenizer(text, **kwargs)

    def apply_chat_template(self, messages: list[dict], **kwargs):
        if kwargs.get("tokenize", True):
            self.longest = max(self.longest, sum(len(m["content"]) for m in messages))
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_a_huge_prompt_is_refused_from_a_prefix_not_tokenized_whole(tmp_path: Path, tok, chat: bool, caplog) -> None:
    """A 10 MB prompt line took ~4 GB and most of a minute to tokenize, only to be refused as over
    data.max_prompt_tokens: a prefix of 32 characters per allowed token decides it."""
    huge = "ab " * 100_000
    prompt = [{"role": "user", "content": huge}] if chat else huge
    path = write_jsonl([{"prompt": "ok"}, {"prompt": prompt}], tmp_path / "d.jsonl")
    spy = TokenizerSpy(tok)
    with pytest.raises(OverlongPrompt) as caught:
        load_prompts(DataConfig(max_prompt_tokens=10), spy, str(path))
    total = len(huge) + (len("<|user|><|assistant|>") if chat else 0)  # "<|user|>": 8 characters, 1 token
    assert str(caught.value) == (
        f"{path}:2: the prompt has at least {313 if chat else 320} tokens (a lower bound, counted in its first 320 "
        f"of {total} characters), more than data.max_prompt_tokens=10"
    )
    assert spy.longest == 320
    with caplog.at_level("WARNING"):
        assert len(load_prompts(DataConfig(max_prompt_tokens=10, overlong_prompts="drop"), spy, str(path))) == 1
    assert "dropped 1 of 2 prompts over data.max_prompt_tokens=10" in caplog.text and spy.longest == 320


def test_a_long_text_of_long_tokens_that_fits_is_tokenized_whole(tmp_path: Path) -> None:
    """Past 32 characters per allowed token, a prefix that fits decides nothing: the whole text is
    tokenized, to the same ids as before the bound."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word = "x" * 100
    model = Tokenizer(models.WordLevel(vocab={"<unk>": 0, word: 1}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    long_tokens = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")
    long_tokens.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    text = " ".join([word] * 10)  # 1009 characters, 10 tokens; the 640-character prefix: 7
    path = write_jsonl([{"prompt": text}, {"prompt": [{"role": "user", "content": text}]}], tmp_path / "d.jsonl")
    records = load_prompts(DataConfig(max_prompt_tokens=10), long_tokens, str(path))
    assert [r.prompt_ids for r in records] == [[1] * 10, [1] * 10]
