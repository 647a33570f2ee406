"""Prompt datasets: local JSONL, Parquet, or a local Hugging Face dataset directory."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoConfig

from slime.config import ConfigError, DataConfig, JobConfig
from slime.data_files import DatasetError, read_rows
from slime.errors import UserError
from slime.sample import Sample, Status

log = logging.getLogger(__name__)


@dataclass
class PromptRecord:
    index: int  # position in the dataset (stable across restarts: the data cursor refers to it)
    prompt: str | list[dict[str, str]]  # text, or chat messages [{"role":..., "content":...}]
    prompt_ids: list[int]  # token ids after the chat template (when applied)
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)  # every other column, plus "task" when present


def prompt_text(record: PromptRecord) -> str:
    """The prompt as the reward sees it: the text, or the chat messages' contents joined by lines."""
    if isinstance(record.prompt, str):
        return record.prompt
    return "\n".join(m.get("content", "") for m in record.prompt)


# Keys the job writes into a sample's metadata beside the row's columns (here, in the fleet, the
# rollout worker, the multi-turn episode and the learner's group scoring). A column of the same
# name would be overwritten, or worse read as the job's own (`loss_masked`), so it is refused.
JOB_METADATA_KEYS: dict[str, str] = {
    "prompt_text": "the prompt as the reward reads it",
    "prompt_messages": "a chat prompt's messages",
    "record_index": "the row's place in the dataset",
    "response_ids": "the response's token ids",
    "finish_reason": "how the response ended (stop, length)",
    "max_new_tokens": "the response's token budget",
    "model_prompt": "the prompt as the model read it",
    "model_response": "the response as the model wrote it",
    "reward_latency_s": "the reward call's seconds",
    "reward_info": "what the reward reported beside its number",
    "env_turns": "the episode's turns",
    "env_return": "the episode's return",
    "env_end": "why the episode ended",
    "env_infos": "the env's last step infos",
    "loss_masked": "why none of the sample's tokens is trained",
    "generated_status": "the status a group reward found",
}


def sample_reward_inputs(
    sample: Sample,
    status: Status,
    tokenizer: Any,
    stop_token_ids: Collection[int],
    model_text: bool = False,
    metadata: dict[str, Any] | None = None,
) -> tuple[str, str, Any, dict[str, Any]]:
    """`reward_inputs` of a generated sample (`metadata`: its own unless given), the metadata told
    how the generation went: `finish_reason` ("length" when `status` says the budget cut it, else
    "stop") and `max_new_tokens` (a slime reward's args.rollout_max_response_len)."""
    ended = {
        "finish_reason": "length" if status == Status.TRUNCATED else "stop",
        "max_new_tokens": sample.max_new_tokens,
    }
    return reward_inputs(
        {**(sample.metadata if metadata is None else metadata), **ended},
        sample.prompt_ids.tolist(),
        sample.response_ids.tolist(),
        tokenizer,
        stop_token_ids,
        model_text,
    )


def reward_metadata(record: PromptRecord) -> dict[str, Any]:
    """What a sample's reward gets as metadata: the row's other columns, `label`, `prompt_text`, and
    for chat messages `prompt_messages` (a TRL-style reward gets them as conversational `prompts`,
    as TRL does for a conversational dataset; a text row stays TRL's standard format)."""
    meta = {**record.metadata, "label": record.label, "prompt_text": prompt_text(record)}
    if not isinstance(record.prompt, str):
        meta["prompt_messages"] = record.prompt
    return meta


def scored_metadata(
    metadata: dict[str, Any],
    prompt_ids: Sequence[int],
    response_ids: list[int],
    tokenizer: Any,
    model_text: bool = False,
) -> dict[str, Any]:
    """The metadata a reward call gets: the sample's, plus `response_ids`, the response's tokens
    (TRL's `completion_ids`), and with `model_text` (an OpenRLHF-style reward: a decode more per
    response, so only for it) `model_prompt`, the prompt as the model read it (chat template or
    data.input_template applied), and `model_response`, the response as the model wrote it
    (special tokens and the stop token kept), which it scores one after the other."""
    meta = {**metadata, "response_ids": response_ids}
    if model_text:
        meta["model_prompt"] = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        meta["model_response"] = tokenizer.decode(response_ids, skip_special_tokens=False)
    return meta


def reward_inputs(
    metadata: dict[str, Any],
    prompt_ids: Sequence[int],
    response_ids: list[int],
    tokenizer: Any,
    stop_token_ids: Collection[int],
    model_text: bool = False,
) -> tuple[str, str, Any, dict[str, Any]]:
    """What a reward scores a response with: (prompt, response, label, metadata). The response is
    its tokens (a list of ints) without a final stop token, decoded without special tokens."""
    meta = scored_metadata(metadata, prompt_ids, response_ids, tokenizer, model_text)
    ids = response_ids[:-1] if response_ids and response_ids[-1] in stop_token_ids else response_ids
    return meta.get("prompt_text", ""), tokenizer.decode(ids, skip_special_tokens=True), meta.get("label"), meta


class ChatTemplateError(UserError, ValueError):
    """The model's chat template is not valid Jinja: no prompt can pass it, whatever the data."""

    hint = "fix the template at the line named (or give the model another chat_template); the data is not at fault"


class OverlongPrompt(DatasetError):
    """A prompt over data.max_prompt_tokens."""

    hint = "raise data.max_prompt_tokens, shorten the prompt, or skip such rows: data.overlong_prompts=drop"


def load_prompts(cfg: DataConfig, tokenizer: Any, path: str | None = None) -> list[PromptRecord]:
    """Read every row of a local dataset into a `PromptRecord`, tokenized and validated.

    `path` overrides `cfg.path`. Columns: `cfg.prompt_key` (text, or chat messages), optional
    `cfg.label_key` (a dotted key reads a nested field: `reward_model.ground_truth`), everything else in `metadata` (plus `metadata["task"]` from `cfg.task_key`).
    Any bad row raises `DatasetError` naming `file:line` (JSONL) or `file:row N` (Parquet, HF).
    """
    raw = path if path is not None else cfg.path
    if raw is None:
        raise DatasetError("load_prompts: no dataset path (data.path is None and no path was given)")
    p = Path(raw).expanduser()
    if not p.exists():
        source = "data.path" if path is None else "load_prompts(path=...)"
        raise DatasetError(f"dataset not found: {p} (from {source})")

    records: list[PromptRecord] = []
    overlong: list[str] = []
    label_key_seen, first_columns, unlabeled = False, None, []  # unlabeled: kept rows lacking it, (where, columns)
    for where, row in read_rows(p):
        has_label = _nested_get(row, cfg.label_key, _ABSENT) is not _ABSENT  # null counts: the row says it has none
        label_key_seen, first_columns = label_key_seen or has_label, first_columns or _key_paths(row)
        try:
            records.append(_to_record(len(records), where, row, cfg, tokenizer))
            if not has_label:
                unlabeled.append((where, _key_paths(row)))
        except OverlongPrompt:
            if cfg.overlong_prompts != "drop":
                raise
            overlong.append(where)
    if overlong:
        log.warning(
            "%s: dropped %d of %d prompts over data.max_prompt_tokens=%d (data.overlong_prompts=drop; first: %s)",
            p,
            len(overlong),
            len(overlong) + len(records),
            cfg.max_prompt_tokens,
            overlong[0],
        )
    if overlong and not records:
        raise OverlongPrompt(
            f"{p}: every prompt ({len(overlong)}) is over data.max_prompt_tokens={cfg.max_prompt_tokens} "
            "(data.overlong_prompts=drop dropped them all)"
        )
    if not records:
        raise DatasetError(f"{p}: the dataset has no rows")
    if cfg.label_key != "label" and not label_key_seen:
        # Named on purpose and in no row: a typo (a verl column beside it would hide it from the warning below).
        raise DatasetError(
            f"{p}: no row has the label column {cfg.label_key!r} (data.label_key); the first row's columns are "
            f"{first_columns}"
        )
    if label_key_seen and unlabeled:  # not a row without a label (that one says null): a row that lost it
        raise DatasetError(
            f"{unlabeled[0][0]}: missing the label column {cfg.label_key!r} (data.label_key), which other rows have "
            f"({len(unlabeled)} of {len(records)} rows lack it); the row has {unlabeled[0][1]}",
            hint=f"give every row its label; a row that has none says so with null ({cfg.label_key!r}: null)",
        )
    if all(r.label is None for r in records) and not _answer_elsewhere(records):  # fine for a judge or an RM
        log.warning(
            "%s: no row has the label column %r (data.label_key), nor verl's reward_model.ground_truth or TRL's "
            "solution/ground_truth: a reward that compares with a label (exact_match, f1, math_answer, ...) will "
            "fail every sample; set data.label_key to the answer's column (a dotted key reads a nested field)",
            p,
            cfg.label_key,
        )
    return records


# Where other frameworks' rows keep the answer: verl's parquet rows (its compute_score gets it as
# ground_truth, rewards/adapters.py), TRL's datasets (its reward functions get the columns as kwargs).
ANSWER_COLUMNS = ("reward_model.ground_truth", "solution", "ground_truth")


def _answer_elsewhere(records: list[PromptRecord]) -> bool:
    """Whether some row carries an answer in one of ANSWER_COLUMNS (a reward reads it from metadata)."""
    return any(_nested_get(r.metadata, key) is not None for key in ANSWER_COLUMNS for r in records)


def write_jsonl(records: list[dict[str, Any]], path: str | Path) -> Path:
    """Write one JSON object per line (creating parent directories); returns the path."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return p


# --- validating and tokenizing ---------------------------------------------------------------


def _to_record(index: int, where: str, row: dict[str, Any], cfg: DataConfig, tokenizer: Any) -> PromptRecord:
    if cfg.prompt_key not in row:
        raise DatasetError(
            f"{where}: missing the prompt column {cfg.prompt_key!r} (data.prompt_key); the row has {sorted(row)}"
        )
    prompt = row[cfg.prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(f"{where}: the prompt ({cfg.prompt_key!r}) is empty")
        if cfg.apply_chat_template:
            messages = _with_system([{"role": "user", "content": prompt}], cfg)
            prompt_ids = _chat_ids(where, messages, tokenizer, cfg.max_prompt_tokens)
        elif cfg.system_prompt is not None:
            raise DatasetError(
                f"{where}: a text prompt is read as it is (data.apply_chat_template=false), so data.system_prompt "
                "cannot reach the model: set data.apply_chat_template=true"
            )
        else:  # data.input_template shapes what the model reads; the reward sees the row's prompt
            text = cfg.input_template.replace("{}", prompt) if cfg.input_template else prompt
            _refuse_overlong_prefix(where, text, tokenizer, cfg.max_prompt_tokens)
            prompt_ids = _text_ids(text, tokenizer)
    elif isinstance(prompt, list):
        if cfg.input_template:
            raise DatasetError(
                f"{where}: the prompt ({cfg.prompt_key!r}) is chat messages, which go through the chat template, so "
                "data.input_template (for text prompts) cannot shape it: unset data.input_template"
            )
        # data.system_prompt joins the messages: a reward given them (TRL's conversational
        # prompts) sees them as the model did.
        prompt = _with_system(_check_messages(where, cfg.prompt_key, prompt), cfg)
        if cfg.apply_chat_template is False:  # set so, not the default
            raise DatasetError(
                f"{where}: the prompt ({cfg.prompt_key!r}) is chat messages, which reach the model only through "
                "the chat template, but data.apply_chat_template=false: unset it (or set true), or give text prompts"
            )
        prompt_ids = _chat_ids(where, prompt, tokenizer, cfg.max_prompt_tokens)
    else:
        raise DatasetError(
            f"{where}: the prompt ({cfg.prompt_key!r}) must be a string or a list of "
            f"{{'role', 'content'}} messages, got {type(prompt).__name__}"
        )

    if not prompt_ids:
        raise DatasetError(f"{where}: the prompt ({cfg.prompt_key!r}) tokenizes to zero tokens")
    if len(prompt_ids) > cfg.max_prompt_tokens:
        raise OverlongPrompt(
            f"{where}: the prompt has {len(prompt_ids)} tokens, more than "
            f"data.max_prompt_tokens={cfg.max_prompt_tokens}"
        )

    label = _nested_get(row, cfg.label_key) if cfg.label_key else None
    metadata = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.label_key)}
    _refuse_shadowed_columns(where, metadata, cfg)
    if cfg.task_key and cfg.task_key in row:
        metadata["task"] = row[cfg.task_key]
    try:  # label and metadata travel to the buffer as JSON
        json.dumps([label, metadata])
    except (TypeError, ValueError):
        _name_non_json_column(where, [(cfg.label_key, label), *metadata.items()])
    return PromptRecord(index=index, prompt=prompt, prompt_ids=prompt_ids, label=label, metadata=metadata)


def _refuse_shadowed_columns(where: str, columns: Mapping[str, Any], cfg: DataConfig) -> None:
    """A column the job would overwrite in the sample's metadata is an error, not a silent loss."""
    for name in columns:
        if name in JOB_METADATA_KEYS:
            raise DatasetError(
                f"{where}: the column {name!r} has the name of a key the job writes into each sample's metadata "
                f"({JOB_METADATA_KEYS[name]}), so the reward would never see the row's value; rename the column"
            )
    if "label" in columns:  # a label_key other than "label" fills metadata["label"]
        raise DatasetError(
            f"{where}: the column 'label' would be hidden by the label read from data.label_key="
            f"{cfg.label_key!r} (the reward's metadata['label']); rename the column, or set data.label_key=label"
        )
    if cfg.task_key and cfg.task_key != "task" and "task" in columns and cfg.task_key in columns:
        raise DatasetError(
            f"{where}: the column 'task' would be hidden by the task read from data.task_key={cfg.task_key!r} "
            "(metadata['task']); rename the column, or set data.task_key=task"
        )


def _key_paths(row: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The row's keys, a nested mapping's as dotted paths (what data.label_key can name)."""
    paths = []
    for k, v in row.items():
        paths.append(prefix + str(k))
        if isinstance(v, Mapping):
            paths.extend(_key_paths(v, f"{prefix}{k}."))
    return paths


_ABSENT = object()


def _nested_get(row: Mapping[str, Any], key: str, missing: Any = None) -> Any:
    """row[key], or for a dotted key absent as a column the nested field (verl's
    `reward_model.ground_truth`); `missing` when a level is missing or not a mapping."""
    if key in row or "." not in key:
        return row.get(key, missing)
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return missing
        value = value[part]
    return value


def _name_non_json_column(where: str, columns: list[tuple[Any, Any]]) -> None:
    for key, value in columns:
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise DatasetError(
                f"{where}: column {key!r} holds {type(value).__name__}, which JSON cannot hold ({exc}); "
                f"the label and every other column reach the buffer and the reward as JSON",
                hint="convert the column to strings or numbers (e.g. timestamps to ISO text), or drop it",
            ) from None


def _check_messages(where: str, key: str, messages: list[Any]) -> list[dict[str, str]]:
    if not messages:
        raise DatasetError(f"{where}: the prompt ({key!r}) is an empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DatasetError(
                f"{where}: chat message {i} of {key!r} must be a dict with 'role' and 'content', got {type(m).__name__}"
            )
        # Arrow gives every message of a column every field any message has, the missing ones None:
        # the template and the reward get the message as it was written.
        m = {k: v for k, v in m.items() if v is not None}
        for field_name in ("role", "content"):
            if not isinstance(m.get(field_name), str):
                got = "missing" if field_name not in m else type(m[field_name]).__name__
                raise DatasetError(f"{where}: chat message {i} of {key!r}: {field_name!r} must be a string, got {got}")
        if not m["role"]:
            raise DatasetError(f"{where}: chat message {i} of {key!r} has an empty 'role'")
        out.append(m)
    if not any(m["content"].strip() for m in out):
        raise DatasetError(f"{where}: the prompt ({key!r}) is chat messages whose contents are all empty")
    return out


def _with_system(messages: list[dict[str, str]], cfg: DataConfig) -> list[dict[str, str]]:
    """data.system_prompt before the messages, unless they bring a system message of their own."""
    if cfg.system_prompt is None or any(m.get("role") == "system" for m in messages):
        return messages
    return [{"role": "system", "content": cfg.system_prompt}, *messages]


def _chat_ids(where: str, messages: list[dict[str, str]], tokenizer: Any, max_tokens: int | None = None) -> list[int]:
    """The messages' token ids after the chat template; with `max_tokens`, a huge prompt over it
    is refused from a prefix of the rendered text (OverlongPrompt) before it is tokenized whole."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DatasetError(
            f"{where}: the prompt needs a chat template (chat messages, or data.apply_chat_template=true) "
            f"but tokenizer {type(tokenizer).__name__} has no chat_template"
        )
    # The rendered text holds the contents: rendered twice only when they alone pass the bound.
    if max_tokens is not None and sum(len(m["content"]) for m in messages) > max_tokens * MAX_CHARS_PER_TOKEN:
        _refuse_overlong_prefix(
            where, _apply_template(where, messages, tokenizer, tokenize=False), tokenizer, max_tokens
        )
    out = _apply_template(where, messages, tokenizer, tokenize=True)
    # transformers < 5 returns list[int]; >= 5 returns a BatchEncoding (a dict) by default.
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return _as_id_list(out)


def _apply_template(where: str, messages: list[dict[str, str]], tokenizer: Any, tokenize: bool) -> Any:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize)
    except jinja2.TemplateSyntaxError as exc:  # the template's own fault, met at its first use
        model_dir = Path(getattr(tokenizer, "name_or_path", None) or "")  # transformers reads the .jinja first
        files = [model_dir / f for f in ("chat_template.jinja", "tokenizer_config.json") if (model_dir / f).is_file()]
        source = files[0] if model_dir.name and files else f"tokenizer {type(tokenizer).__name__}"
        raise ChatTemplateError(
            f"{source}: the chat template is not valid Jinja, line {exc.lineno}: {exc.message}"
        ) from exc
    except Exception as exc:  # jinja2's TemplateError (raise_exception: "System role not supported"), ...
        roles = [m["role"] for m in messages]
        raise DatasetError(
            f"{where}: the tokenizer's chat template refused these messages (roles {roles}): "
            f"{type(exc).__name__}: {exc}",
            hint="change the messages to what the model's chat template accepts (some templates refuse a "
            "'system' message: fold it into the first user message), or give the model another chat_template",
        ) from exc


# A token of any common vocabulary is far shorter than this, so a text longer than this many
# characters per allowed token is judged from a prefix that long: tokenizing a 10 MB prompt whole
# took gigabytes and most of a minute, only to refuse it.
MAX_CHARS_PER_TOKEN = 32


def _refuse_overlong_prefix(where: str, text: str, tokenizer: Any, max_tokens: int) -> None:
    """OverlongPrompt when a prefix of `text` alone has more than `max_tokens` tokens; a text
    within the bound, or whose prefix fits, is left to be tokenized whole."""
    limit = max_tokens * MAX_CHARS_PER_TOKEN
    if len(text) <= limit:
        return
    count = len(_text_ids(text[:limit], tokenizer))
    if count > max_tokens:
        raise OverlongPrompt(
            f"{where}: the prompt has at least {count} tokens (a lower bound, counted in its first {limit} of "
            f"{len(text)} characters), more than data.max_prompt_tokens={max_tokens}"
        )


def _text_ids(text: str, tokenizer: Any) -> list[int]:
    return _as_id_list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _as_id_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if len(ids) == 1 and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


def check_prompts_fit(prompt_lengths: list[int], model_dir: str) -> None:
    """A prompt as long as the model's context leaves no room for one response token: every
    response was empty (truncated at once, reward called on ""), and the job trained nothing."""
    context = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)
    too_long = [n for n in prompt_lengths if context is not None and n >= context]
    if too_long:
        raise ConfigError(
            f"{len(too_long)} of {len(prompt_lengths)} prompts (the longest {max(too_long)} tokens) fill the model's "
            f"context (max_position_embeddings={context} in {model_dir}): no room for a response. Set "
            f"data.max_prompt_tokens below {context} (with data.overlong_prompts=drop to skip those rows)"
        )


def check_context_fits(cfg: JobConfig, model_dir: str) -> None:
    """The engines refuse a response budget longer than the model reads and a top_k beyond its
    vocabulary (validate_sampling in the engine contract): say so at start, naming the field,
    instead of failing every request (eval's only at its first evaluation, after training). With
    rollout.engine=vllm, vllm.max_model_len is the context (vLLM refuses one past the model's in
    the worker's constructor)."""
    model_config = AutoConfig.from_pretrained(model_dir)
    context = getattr(model_config, "max_position_embeddings", None)
    where = f"the model's context (max_position_embeddings={context} in {model_dir})"
    own = cfg.vllm.max_model_len if cfg.rollout.engine == "vllm" else None
    if own is not None and context is not None and own > context:
        raise ConfigError(f"vllm.max_model_len={own} exceeds {where}")
    if own is not None:
        context, where = own, f"vllm.max_model_len={own}"
    budgets = {"rollout.max_new_tokens": cfg.rollout.max_new_tokens, "eval.max_new_tokens": cfg.eval.max_new_tokens}
    for key, budget in budgets.items():
        if context is not None and budget is not None and budget > context:
            raise ConfigError(f"{key}={budget} exceeds {where}")
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is not None and cfg.rollout.top_k > vocab:
        raise ConfigError(f"rollout.top_k={cfg.rollout.top_k} exceeds the model's vocabulary (vocab_size={vocab})")
