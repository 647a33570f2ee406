"""Held-out evaluation: `slime eval RUN_DIR|MODEL_DIR --data FILE [--samples k]`, and `eval.every_steps`
inside a job. One definition of the numbers for both, and for the benchmarks:

- every prompt once greedy (temperature 0): `greedy_reward_mean`, `greedy_pass_rate`;
- with `samples` k > 0, k samples of each at `eval.temperature`, from a fixed seed: `sampled_reward_mean`,
  `pass_at_1` and `pass_at_k` (the unbiased estimator of Chen et al. 2021 over the k samples);
- a response passes when its reward is at least `eval.pass_threshold` (1.0: only a perfect score);
- response lengths (of the greedy responses), the share cut by max_new_tokens, the rewards that failed;
- each figure per task type too (`by_task/<task>/...`), when the prompts name tasks (`data.task_key`).

The reward is the job's (`reward.*`), called through the same service the rollout workers use.
Standalone (`slime eval`) the model runs on a fresh engine of `rollout.engine` (the built-in one by
default); inside a job, on the rollout engines themselves, holding the weights just pushed (the
fleet's `generate_for_eval`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from rewards.group import GroupScorer, load_group_reward
from slime.config import EvalConfig, JobConfig, load_config
from slime.data import PromptRecord, load_prompts, reward_inputs, reward_metadata, write_jsonl
from slime.engines import make_engine, run_to_completion
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.errors import UserError
from slime.export import EXPORT_INFO, ExportError, base_model_dir, config_of, export_checkpoint, find_checkpoint
from slime.model import ensure_model_dir, load_tokenizer, rollout_stop_strings, rollout_stop_token_ids

EXAMPLE_HELD_OUT_SEED = 10_000  # the example task's held-out prompts; training draws with data.seed


class EvalError(UserError, ValueError):
    """An evaluation that cannot run: names the path or setting."""

    hint = "slime eval RUN_DIR|MODEL_DIR --data FILE.jsonl [--samples k] [key=value ...] (README, 'After the run')"


# ---- the requests and their answers ------------------------------------------------------------
def eval_requests(
    records: Sequence[PromptRecord],
    cfg: EvalConfig,
    max_new_tokens: int,
    stop: list[int],
    stop_strings: Sequence[str] = (),
):
    """Greedy once per prompt (`eval-I-g`), then `cfg.samples` sampled (`eval-I-sK`); they stop as
    the rollout does (`stop`: its stop tokens; `stop_strings`: its stop strings of several tokens).
    Each sampled request has a seed of its own (from eval.seed, I and K): its tokens do not depend on
    the engine it lands on or what runs beside it, so the job's eval/* and `slime eval` agree."""
    greedy = SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop, stop_strings=list(stop_strings)
    )
    requests = [GenerationRequest(f"eval-{i}-g", list(r.prompt_ids), greedy) for i, r in enumerate(records)]
    for i, r in enumerate(records):
        for k in range(cfg.samples):
            seed = (cfg.seed * 1_000_003 + i * cfg.samples + k) % 2**63
            sampled = replace(greedy, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=seed)
            requests.append(GenerationRequest(f"eval-{i}-s{k}", list(r.prompt_ids), sampled))
    return requests


# ---- scoring -----------------------------------------------------------------------------------
def pass_at_k(n: int, correct: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n passes), `correct` of n passing."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def score_answers(
    records: Sequence[PromptRecord],
    answers: dict[str, dict[str, Any]],
    tokenizer: Any,
    stop: list[int],
    rewards: Any,
    timeout_s: float,
    max_new_tokens: int,
    model_text: bool = False,
) -> dict[str, tuple[float | None, str | None]]:
    """request id -> (reward, failure), each response scored as the rollout worker scores it:
    the stop token cut, the rest decoded without special tokens, the metadata told how it ended
    (`finish_reason`, `max_new_tokens`: a slime reward's TRUNCATED status). `rewards`: the job's
    reward service, or with reward.scope=group its GroupScorer (each prompt's answers scored together)."""

    def metadata(record: PromptRecord, answer: dict[str, Any]) -> dict[str, Any]:
        ended = "length" if answer["finish_reason"] == "length" else "stop"
        return {**reward_metadata(record), "finish_reason": ended, "max_new_tokens": max_new_tokens}

    inputs = {
        rid: reward_inputs(
            metadata(record, answer), record.prompt_ids, answer["token_ids"], tokenizer, stop, model_text
        )
        for rid, answer in answers.items()
        for record in [records[int(rid.split("-")[1])]]
    }
    if isinstance(rewards, GroupScorer):
        by_prompt: dict[str, list[str]] = {}
        for rid in inputs:
            by_prompt.setdefault(rid.split("-")[1], []).append(rid)
        groups = list(by_prompt.values())
        results = rewards.score([[inputs[rid] for rid in group] for group in groups])
        return {rid: (r.reward, r.failure) for group, rs in zip(groups, results) for rid, r in zip(group, rs)}
    futures: dict[str, Future] = {rid: rewards.submit(*item) for rid, item in inputs.items()}
    scores = {}
    for rid, future in futures.items():
        result = future.result(timeout=timeout_s)
        scores[rid] = (result.reward, result.failure)
    return scores


def eval_rewards(job: JobConfig) -> tuple[Any, bool]:
    """What scores the answers: the job's reward service, or with reward.scope=group a GroupScorer;
    and whether it reads metadata["model_prompt"] and ["model_response"] (OpenRLHF-style)."""
    if job.reward.scope == "group":
        scorer = GroupScorer(load_group_reward(job.reward.fn), job.reward.timeout_s, job.reward.max_concurrency)
        return scorer, scorer.reads_model_text
    from rewards.service import make_reward_service, wants_model_text

    return make_reward_service(job.reward, job.job_name), wants_model_text(job.reward)


def summarize(
    records: Sequence[PromptRecord],
    answers: dict[str, dict[str, Any]],
    scores: dict[str, tuple[float | None, str | None]],
    cfg: EvalConfig,
) -> dict[str, Any]:
    """The figures, overall and per task (a failed reward counts as 0 and is counted)."""

    def figures(indices: list[int]) -> dict[str, float]:
        greedy = [scores[f"eval-{i}-g"][0] or 0.0 for i in indices]
        lengths = [len(answers[f"eval-{i}-g"]["token_ids"]) for i in indices]
        out = {
            "prompts": float(len(indices)),
            "greedy_reward_mean": statistics.fmean(greedy),
            "greedy_pass_rate": statistics.fmean(float(r >= cfg.pass_threshold) for r in greedy),
            "response_len_mean": statistics.fmean(lengths),
            "response_len_p50": float(statistics.median(lengths)),
            "response_len_max": float(max(lengths)),
            "truncated_share": statistics.fmean(
                float(answers[f"eval-{i}-g"]["finish_reason"] == "length") for i in indices
            ),
        }
        if cfg.samples:
            k = cfg.samples
            sampled = [[scores[f"eval-{i}-s{j}"][0] or 0.0 for j in range(k)] for i in indices]
            passed = [sum(r >= cfg.pass_threshold for r in row) for row in sampled]
            out["sampled_reward_mean"] = statistics.fmean(r for row in sampled for r in row)
            out["pass_at_1"] = statistics.fmean(pass_at_k(k, c, 1) for c in passed)
            out[f"pass_at_{k}"] = statistics.fmean(pass_at_k(k, c, k) for c in passed)
        return out

    result: dict[str, Any] = figures(list(range(len(records))))
    result["failed_rewards"] = float(sum(1 for _, failure in scores.values() if failure is not None))
    tasks: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        task = record.metadata.get("task")
        if task is not None:
            tasks.setdefault(str(task), []).append(i)
    if tasks:
        result["by_task"] = {task: figures(indices) for task, indices in sorted(tasks.items())}
    return result


def first_failure(scores: dict[str, tuple[float | None, str | None]]) -> str | None:
    return next((failure for _, failure in scores.values() if failure is not None), None)


# ---- the held-out prompts ----------------------------------------------------------------------
EXAMPLE_HELD_OUT_PROMPTS = 64


def held_out_records(job: JobConfig, tokenizer: Any, work_dir: Path) -> list[PromptRecord]:
    """`eval.data` (its first `eval.num_prompts` rows when set), or for the generated example task
    (data.path unset) `eval.num_prompts` (64) new prompts from a seed of their own (written to
    work_dir/eval_prompts.jsonl)."""
    cfg = job.eval
    path = cfg.data
    if path is None:
        if job.data.path is not None:
            raise EvalError("eval.every_steps is set but eval.data is not: name a held-out JSONL for your data.path")
        from envs import repeat  # the example task

        rows = repeat.make_dataset(cfg.num_prompts or EXAMPLE_HELD_OUT_PROMPTS, EXAMPLE_HELD_OUT_SEED)
        path = str(write_jsonl(rows, work_dir / "eval_prompts.jsonl"))
    return load_prompts(job.data, tokenizer, path)[: cfg.num_prompts]


# ---- inside a job: `eval.every_steps` -------------------------------------------------------------
class HeldOutEval:
    """The job's evaluation: its held-out prompts and reward service, built once; `run` scores the
    weights the rollout engines hold through `generate` (the fleet's generate_for_eval)."""

    def __init__(self, job: JobConfig, tokenizer: Any, run_dir: Path) -> None:
        self.job, self.tokenizer = job, tokenizer
        self.records = held_out_records(job, tokenizer, run_dir)
        self.stop = rollout_stop_token_ids(job.rollout, tokenizer)
        self.stop_strings = rollout_stop_strings(job.rollout, tokenizer)
        self.rewards, self.model_text = eval_rewards(job)

    def due(self, step: int) -> bool:
        every = self.job.eval.every_steps
        return bool(every) and ((step + 1) % every == 0 or step + 1 == self.job.steps)

    def run(self, generate: Callable[[list[GenerationRequest]], dict[str, dict[str, Any]]]) -> dict[str, Any]:
        job = self.job
        started = time.time()
        requests = eval_requests(
            self.records, job.eval, job.eval.max_new_tokens or job.rollout.max_new_tokens, self.stop, self.stop_strings
        )
        answers = generate(requests)
        timeout = job.reward.timeout_s * 4 + 30
        max_new = job.eval.max_new_tokens or job.rollout.max_new_tokens
        scores = score_answers(
            self.records, answers, self.tokenizer, self.stop, self.rewards, timeout, max_new, self.model_text
        )
        return {**summarize(self.records, answers, scores, job.eval), "seconds": time.time() - started}

    def close(self) -> None:
        self.rewards.close()


# ---- standalone: `slime eval` ------------------------------------------------------------------
def evaluate_model_dir(
    job: JobConfig, model_dir: Path, records: Sequence[PromptRecord], tokenizer: Any = None
) -> dict[str, Any]:
    """The figures of the model in `model_dir` on `records`, on a fresh engine of `rollout.engine`
    (`tokenizer`: when `model_dir` has none, e.g. a 1-rank checkpoint's policy/)."""
    tokenizer = tokenizer or load_tokenizer(model_dir)
    stop = rollout_stop_token_ids(job.rollout, tokenizer)
    max_new = job.eval.max_new_tokens or job.rollout.max_new_tokens
    requests = eval_requests(records, job.eval, max_new, stop, rollout_stop_strings(job.rollout, tokenizer))
    started = time.time()
    engine = make_engine(job, str(model_dir), 0, 0)
    try:
        answers = run_to_completion(engine, requests)
    finally:
        engine.close()
    rewards, model_text = eval_rewards(job)
    try:
        scores = score_answers(
            records, answers, tokenizer, stop, rewards, job.reward.timeout_s * 4 + 30, max_new, model_text
        )
    finally:
        rewards.close()
    result = summarize(records, answers, scores, job.eval)
    result["seconds"] = time.time() - started
    if first_failure(scores):
        result["first_failure"] = first_failure(scores)
    return result


def _exported_from(export: Path) -> str | None:
    """The checkpoint `slime export` wrote `export` from (its EXPORT_INFO), when it says."""
    try:
        return str(json.loads((export / EXPORT_INFO).read_text())["checkpoint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _job_config(path: Path, overrides: list[str], step: int | None = None) -> tuple[JobConfig, Path | None]:
    """(the config to evaluate with, the run dir) of a run dir, a checkpoint or a model directory.
    A checkpoint is evaluated with the settings that trained it (a resume may have changed them)."""
    run_dir = None
    if (path / "driver_state.json").is_file():
        run_dir = path.parent.parent
    elif (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file():
        run_dir = path
    if run_dir is not None:
        try:
            config = config_of(find_checkpoint(path, step))
        except ExportError:  # no checkpoint: the run's own config, and main() names what is missing
            config = run_dir / "config.yaml"
        if not config.is_file():
            raise EvalError(f"{run_dir}: a run dir without config.yaml")
        return _run_settings(config, overrides), run_dir
    if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
        checkpoint = _exported_from(path) or "RUN_DIR"
        raise EvalError(
            f"{path}: a LoRA adapter export (adapter_config.json), not a whole model; export it with the adapters "
            f"merged first: `slime export {checkpoint} --out DIR --merged`, then `slime eval DIR` (or `slime eval "
            f"{checkpoint}`, which merges them itself)"
        )
    if not (path / "config.json").is_file():
        raise EvalError(f"{path}: neither a run dir (checkpoints/, config.yaml) nor a model directory (config.json)")
    exported_from = _exported_from(path)
    source_config = config_of(Path(exported_from)) if exported_from else None
    if source_config is not None and source_config.is_file():
        # An export scores as its run did (reward, data reading, rollout), when that run is still here.
        print(
            f"slime eval: the reward, data and rollout settings of {source_config} (what trained this export)",
            file=sys.stderr,
        )
        # Its own model.path, but the precision its engines ran in (a bf16 run scores as in bf16).
        dtype = ((yaml.safe_load(source_config.read_text()) or {}).get("model") or {}).get("dtype")
        given = [f"model.path={path}", *([f"model.dtype={dtype}"] if dtype else []), *overrides]
        return _run_settings(source_config, given, sections=RUN_SECTIONS[1:]), None
    if not any(o.startswith(("reward.", "env.")) for o in overrides):
        print(
            f"slime eval: {path} brings no reward settings, so the example task's reward scores it; "
            "give yours with reward.fn=FILE:FUNCTION (and data.*, rollout.max_new_tokens as your job had them)",
            file=sys.stderr,
        )
    return load_config(None, [f"model.path={path}", *overrides]), None


# The run's model, data reading, rollout and reward; not its Redis, cluster or secrets.
RUN_SECTIONS = ("model", "data", "rollout", "reward", "env", "eval", "seed")


def _run_settings(config: Path, overrides: list[str], sections: tuple[str, ...] = RUN_SECTIONS) -> JobConfig:
    data = yaml.safe_load(config.read_text()) or {}
    keep = {k: data[k] for k in sections if k in data}
    with tempfile.TemporaryDirectory(prefix="slime-eval-") as tmp:
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(yaml.safe_dump(keep))
        return load_config(config_file, overrides)


def main_eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="slime eval",
        description="Score a checkpoint or a model on held-out prompts with the job's reward: mean reward, "
        "pass@1, pass@k, per task type, response lengths. Prints a table, then one JSON line.",
    )
    parser.add_argument("path", type=Path, help="a run's output_dir, one checkpoint in it, or a model directory")
    parser.add_argument("--data", required=True, help="held-out prompts (JSONL/Parquet, read with data.* settings)")
    parser.add_argument(
        "--samples", type=int, default=None, help="sampled responses per prompt (pass@k); 0: greedy only"
    )
    parser.add_argument("--step", type=int, default=None, help="a run dir's checkpoint after N steps (default: newest)")
    parser.add_argument("overrides", nargs="*", help="key.path=value, e.g. reward.fn=mod:fn eval.temperature=0.7")
    ns = parser.parse_intermixed_args(argv)
    path = ns.path.expanduser()
    extra = [*ns.overrides, *([f"eval.samples={ns.samples}"] if ns.samples is not None else [])]
    job, run_dir = _job_config(path, extra, ns.step)
    with tempfile.TemporaryDirectory(prefix="slime-eval-") as tmp:
        if run_dir is not None:
            try:
                checkpoint = find_checkpoint(path, ns.step)
            except ExportError as exc:
                raise EvalError(str(exc)) from None
            model_dir = export_checkpoint(checkpoint, Path(tmp) / "model", base_model_dir(checkpoint))
            source = str(checkpoint)
        else:
            model_dir, source = ensure_model_dir(job.model), str(path)
        records = load_prompts(job.data, load_tokenizer(model_dir), ns.data)
        result = evaluate_model_dir(job, model_dir, records)
    print(format_table(result, job.eval))
    print(json.dumps({"source": source, "data": ns.data, **result}))
    scored = len(records) * (1 + job.eval.samples)
    if result.get("failed_rewards", 0) >= scored:
        print(
            f"slime eval: every reward call failed ({scored} of {scored}), so these figures measure nothing; "
            f"e.g. {result.get('first_failure')}",
            file=sys.stderr,
        )
        return 1
    return 0


def format_table(result: dict[str, Any], cfg: EvalConfig) -> str:
    columns = ["prompts", "greedy_reward_mean", "greedy_pass_rate", "response_len_mean", "truncated_share"]
    if cfg.samples:
        columns += ["sampled_reward_mean", "pass_at_1", f"pass_at_{cfg.samples}"]
    rows = [("all", result), *((f"task {t}", f) for t, f in result.get("by_task", {}).items())]
    head = f"{'':<16}" + "".join(f"{c:>20}" for c in columns)
    lines = [head] + [f"{name:<16}" + "".join(f"{f[c]:>20.3f}" for c in columns) for name, f in rows]
    if result.get("failed_rewards"):
        lines.append(
            f"{result['failed_rewards']:.0f} rewards failed (counted as 0), e.g. {result.get('first_failure')}"
        )
    return "\n".join(lines)
