"""After the run: `slime export` (a Hugging Face directory from any checkpoint) and `slime eval`
(held-out reward, pass@k, per task), standalone and inside a job (`eval.every_steps`).

The exported directory is checked with plain `transformers`: it loads, its weights are the
checkpoint's, and its greedy tokens are the engine's on 8 prompts. The 2-rank (sharded) export is
checked in test_learner_group.py, beside the 2-rank job that writes the checkpoint."""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import slime.export as export_module
from envs import repeat
from slime.cli import main
from slime.config import EvalConfig, load_config
from slime.data import PromptRecord, write_jsonl
from slime.engines.builtin import BuiltinEngine
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.evaluation import main_eval, pass_at_k, summarize
from slime.export import ExportError, export_checkpoint, find_checkpoint
from tests.helpers import TINY_JOB

ROOT = Path(__file__).resolve().parents[1]
TIE_LOGIT_GAP = 5e-4  # as in test_families: past a near-tie of the model's own logits both continuations are right


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0  # one of four passes: some draw of all four holds it
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)


def test_the_figures_overall_and_per_task_count_a_failed_reward_as_zero():
    records = [PromptRecord(i, "p", [1], "x", {"task": t}) for i, t in enumerate(["a", "a", "b"])]
    answers = {f"eval-{i}-g": {"token_ids": [5] * (i + 1), "finish_reason": "stop"} for i in range(3)}
    answers["eval-2-g"]["finish_reason"] = "length"
    scores = {"eval-0-g": (1.0, None), "eval-1-g": (0.5, None), "eval-2-g": (None, "raised ValueError")}
    for i, rewards in enumerate([(1.0, 0.0), (1.0, 1.0), (0.2, None)]):
        for k, r in enumerate(rewards):
            answers[f"eval-{i}-s{k}"] = {"token_ids": [5], "finish_reason": "stop"}
            scores[f"eval-{i}-s{k}"] = (r, None if r is not None else "timed out")
    out = summarize(records, answers, scores, EvalConfig(samples=2))
    assert out["greedy_reward_mean"] == pytest.approx(1.5 / 3)
    assert out["greedy_pass_rate"] == pytest.approx(1 / 3)
    assert out["sampled_reward_mean"] == pytest.approx(3.2 / 6)
    assert out["pass_at_1"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert out["pass_at_2"] == pytest.approx(2 / 3)
    assert out["failed_rewards"] == 2
    assert out["response_len_mean"] == 2 and out["truncated_share"] == pytest.approx(1 / 3)
    assert out["by_task"]["a"]["greedy_reward_mean"] == pytest.approx(0.75)
    assert out["by_task"]["b"]["pass_at_2"] == 0.0


def _engine_greedy(model, prompts: list[list[int]], eos: int, max_new: int = 24) -> list[list[int]]:
    engine = BuiltinEngine(model, max_running_requests=len(prompts))
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=[eos])
    out = engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return [out[f"r{i}"].token_ids for i in range(len(prompts))]


def assert_greedy_tokens_match(export_dir: Path, engine_model, prompts: list[list[int]], got=None) -> None:
    """Plain transformers on the exported directory against the built-in engine on `engine_model`
    (or against `got`, another engine's greedy tokens with EOS as the stop), token for token."""
    hf = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    eos = AutoTokenizer.from_pretrained(export_dir).eos_token_id
    got = got if got is not None else _engine_greedy(engine_model, prompts, eos)
    assert len(got) == len(prompts)
    for prompt, g in zip(prompts, got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=eos)
        want = out[0, len(prompt) :].tolist()
        first = next((i for i, (a, b) in enumerate(zip(g, want)) if a != b), None)
        if first is None:
            assert len(g) == len(want) or g[-1:] == [eos] or want[-1:] == [eos]
            continue
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + want[:first]])).logits[0, -1]
        assert abs(float(logits[g[first]] - logits[want[first]])) < TIE_LOGIT_GAP, (prompt, g, want)


def _prompts(tokenizer, n: int = 8) -> list[list[int]]:
    return [tokenizer(p["prompt"], add_special_tokens=False)["input_ids"] for p in repeat.make_dataset(n, seed=77)]


@pytest.mark.slow
def test_a_job_evaluates_on_its_engines_exports_every_checkpoint_and_slime_eval_agrees(
    tiny_model_dir, tmp_path, capsys
):
    """A local job with eval.every_steps=1 and checkpoint.export_hf: eval/* at each step; the
    checkpoint's hf/ loads in plain transformers with the trained weights and the engine's greedy
    tokens; `slime eval` of the run gives the job's last held-out figures. Its MLflow server is
    down: the job goes on and says so once, without the URI's password."""
    from slime.train import train

    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "cluster.launcher=local",
            "job_name=eval-export",
            f"output_dir={run}",
            f"model.path={tiny_model_dir}",
            *TINY_JOB,
            "steps=2",
            "rollout.num_workers=1",
            "eval.every_steps=1",
            "eval.num_prompts=8",
            "eval.samples=2",
            "checkpoint.export_hf=true",
            "logging.mlflow.tracking_uri=http://user:pw-SECRET@127.0.0.1:9",
        ],
    )
    history = train(cfg)
    said = capsys.readouterr()
    mlflow_lines = [line for line in (said.out + said.err).splitlines() if "mlflow" in line.lower()]
    assert len(mlflow_lines) == 1 and "127.0.0.1:9" in mlflow_lines[0], mlflow_lines
    assert "pw-SECRET" not in said.out + said.err
    assert [h["step"] for h in history] == [0, 1]
    for h in history:
        assert h["eval/prompts"] == 8 and 0 <= h["eval/greedy_reward_mean"] <= 1 and "eval/pass_at_2" in h
        assert h["eval/by_task/repeat/prompts"] == 8
    assert history[-1]["eval/policy_version"] == 2  # the weights pushed after the last step

    checkpoint = find_checkpoint(run)
    export = checkpoint / "hf"
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(checkpoint / "policy", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(hf.state_dict()[name], tensor), name
    assert any(not torch.equal(base.state_dict()[n], t) for n, t in trained.state_dict().items())
    tokenizer = AutoTokenizer.from_pretrained(export)  # the char tokenizer travels with the export
    assert tokenizer("ab12")["input_ids"] == AutoTokenizer.from_pretrained(tiny_model_dir)("ab12")["input_ids"]
    assert_greedy_tokens_match(export, trained, _prompts(tokenizer))

    assert main_eval([str(run), "--step", "2", "--data", str(run / "eval_prompts.jsonl"), "eval.samples=0"]) == 0
    # the engine at the last step held this checkpoint's weights: the same greedy responses
    out = _eval_json(capsys, [str(run), "--data", str(run / "eval_prompts.jsonl"), "--samples", "2"])
    assert out["greedy_reward_mean"] == pytest.approx(history[-1]["eval/greedy_reward_mean"], abs=1e-9)
    # the samples too: each has a seed of its own, not the stream the job's engine had drawn from
    for figure in ("sampled_reward_mean", "pass_at_1", "pass_at_2"):
        assert out[figure] == pytest.approx(history[-1][f"eval/{figure}"], abs=1e-9), figure
    assert out["prompts"] == 8 and out["source"] == str(checkpoint)
    # an export scores with the reward and rollout settings that trained its checkpoint (slime_export.json names it)
    code, said, err = _cli(capsys, "eval", str(export), "--data", str(run / "eval_prompts.jsonl"))
    settings = checkpoint / "config.yaml"
    assert code == 0 and f"the reward, data and rollout settings of {settings}" in err, err[-2000:]
    from_export = json.loads(said.strip().splitlines()[-1])
    assert from_export["greedy_reward_mean"] == pytest.approx(out["greedy_reward_mean"], abs=1e-9)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`slime ARGV` in this process (the CLI's own entry: errors become exit 2 and one line)."""
    capsys.readouterr()
    code = main(list(argv))
    said = capsys.readouterr()
    return code, said.out, said.err


def _eval_json(capsys, args: list[str]) -> dict:
    code, out, err = _cli(capsys, "eval", *args)
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_slime_eval_of_a_model_dir_is_what_plain_generate_and_the_reward_give(tiny_model_dir, tmp_path, capsys):
    """An independent check of the greedy figure: transformers' generate, decoded, scored by the
    example's reward."""
    data = write_jsonl(repeat.make_dataset(8, seed=123), tmp_path / "held_out.jsonl")
    code, said, err = _cli(capsys, "eval", str(tiny_model_dir), "--data", str(data), "rollout.max_new_tokens=24")
    assert code == 0 and "brings no reward settings, so the example task's reward scores it" in err, err[-2000:]
    out = json.loads(said.strip().splitlines()[-1])
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rewards = []
    for row in repeat.make_dataset(8, seed=123):
        ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id
            )
        response = [t for t in gen[0, len(ids) :].tolist() if t != tokenizer.eos_token_id]
        rewards.append(repeat.score(tokenizer.decode(response, skip_special_tokens=True), row["label"]))
    assert out["greedy_reward_mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1 / 8 + 1e-9)
    assert out["prompts"] == 8 and math.isfinite(out["response_len_mean"]) and "pass_at_1" not in out


def test_eval_num_prompts_caps_a_held_out_file_and_sizes_the_example_set(tmp_path):
    from slime.evaluation import held_out_records
    from tests.helpers import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    data = write_jsonl(repeat.make_dataset(10, seed=5), tmp_path / "held_out.jsonl")
    for extra, expected in [([], 10), (["eval.num_prompts=4"], 4)]:
        job = load_config(None, [f"data.path={data}", f"eval.data={data}", *extra])
        records = held_out_records(job, tokenizer, tmp_path)
        assert [r.index for r in records] == list(range(expected))  # the file's first rows
    assert len(held_out_records(load_config(None, []), tokenizer, tmp_path)) == 64
    assert len(held_out_records(load_config(None, ["eval.num_prompts=5"]), tokenizer, tmp_path)) == 5


def test_slime_eval_exits_1_when_every_reward_call_failed(tiny_model_dir, tmp_path, capsys):
    """Figures made only of failed rewards (counted as 0) measure nothing: a script must see it."""
    data = write_jsonl(repeat.make_dataset(3, seed=1), tmp_path / "held_out.jsonl")
    (tmp_path / "broken.py").write_text("def score(prompt, response, label, metadata):\n    return len(None)\n")
    args = [str(tiny_model_dir), "--data", str(data), "rollout.max_new_tokens=4", "--samples", "1"]
    code, said, err = _cli(capsys, "eval", *args, f"reward.fn={tmp_path / 'broken.py'}:score")
    assert code == 1 and json.loads(said.strip().splitlines()[-1])["failed_rewards"] == 6
    assert "every reward call failed (6 of 6), so these figures measure nothing" in err and "TypeError" in err


SLIME_NO_CREDIT_WHEN_CUT = """
from slime.utils.types import Sample


async def rm(args, sample, **kwargs):
    cut = sample.status == Sample.Status.TRUNCATED and args.rollout_max_response_len == 2
    return 0.0 if cut else 1.0
"""


def test_slime_eval_tells_a_reward_how_each_response_ended_as_training_does(tiny_model_dir, tmp_path, capsys):
    """Eval scored every response as stopped: a reward that gives no credit to a cut response gave
    eval 1.0 where training gave 0.0, on the same responses."""
    data = write_jsonl(repeat.make_dataset(3, seed=1), tmp_path / "held_out.jsonl")
    (tmp_path / "cut.py").write_text(SLIME_NO_CREDIT_WHEN_CUT)
    args = [str(tiny_model_dir), "--data", str(data), "rollout.max_new_tokens=2", "--samples", "2"]
    out = _eval_json(capsys, [*args, f"reward.fn={tmp_path / 'cut.py'}:rm", "rollout.ignore_eos=true"])
    assert out["truncated_share"] == 1.0 and out["greedy_reward_mean"] == 0.0


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["export", "{run}", "--out", "{tmp}/x"], "no complete checkpoint in"),
        (["export", "{run}", "--step", "7", "--out", "{tmp}/x"], "no checkpoint after step 7; there are [3]"),
        (["export", "{tmp}/nowhere", "--out", "{tmp}/x"], "no such directory"),
        (["eval", "{tmp}/nowhere", "--data", "{tmp}/d.jsonl"], "neither a run dir"),
    ],
)
def test_bad_paths_and_steps_get_one_line_naming_them(tmp_path, capsys, args, said):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    if "7" in args:
        (run / "checkpoints" / "step_000003").mkdir()
        (run / "checkpoints" / "step_000003" / "driver_state.json").write_text('{"next_step": 3}')
    code, _, err = _cli(capsys, *(a.format(run=run, tmp=tmp_path) for a in args))
    assert code == 2, err[-2000:]
    first = err.strip().splitlines()[0]
    assert first.startswith("slime: ") and said in first and "Traceback" not in err


def test_an_export_replaces_the_old_one_whole_and_names_its_checkpoint(tiny_model_dir, tmp_path):
    """A 1-rank checkpoint as the learner writes it (policy/ without a tokenizer), exported twice
    into the same directory: the second replaces the first; the info file names the source."""
    from slime.config import dump_config

    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000004"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.save_pretrained(checkpoint / "policy")
    (checkpoint / "driver_state.json").write_text(json.dumps({"next_step": 4}))
    dump_config(load_config(None, [f"model.path={tiny_model_dir}"]), run / "config.yaml")
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("from before")
    (out / "slime_export.json").write_text("{}")  # an earlier export: replaced whole
    export_checkpoint(find_checkpoint(run, 4), out)
    assert not (out / "stale.txt").exists()
    for target in (tmp_path, run, checkpoint, notes := tmp_path / "notes"):  # never deleted
        if target is notes:
            notes.mkdir()
            (notes / "keep.txt").write_text("mine")
        with pytest.raises(ExportError):
            export_checkpoint(find_checkpoint(run, 4), target)
    assert (notes / "keep.txt").exists() and (checkpoint / "driver_state.json").exists()
    # The base model the run trained from, itself an earlier export: never replaced by an export of it.
    base = Path(shutil.copytree(tiny_model_dir, tmp_path / "base"))
    (base / "slime_export.json").write_text("{}")
    with pytest.raises(ExportError, match="holds the base model the run trained from"):
        export_checkpoint(find_checkpoint(run, 4), base, base)
    assert (base / "config.json").is_file()
    info = json.loads((out / "slime_export.json").read_text())
    assert info["checkpoint"] == str(checkpoint.resolve()) and info["steps"] == 4
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert_greedy_tokens_match(out, model, _prompts(tokenizer))
    # Readable as the umask allows (mkdtemp made it 0700 and safetensors 0600): a server of another
    # user loads it.
    umask = os.umask(0o022)
    try:
        export_checkpoint(find_checkpoint(run, 4), out)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
    link = tmp_path / "link"
    link.symlink_to(out)
    with pytest.raises(ExportError, match="is a symbolic link"):  # was a raw OSError from rmtree
        export_checkpoint(find_checkpoint(run, 4), link)


def test_a_checkpoint_written_again_holds_none_of_the_old_ones_files(tmp_path):
    """A run resumed from an older checkpoint writes the later steps again: the old step_N's files
    (another layout, its hf/) stayed beside the new ones, and export, eval and resume read them."""
    from slime.export import clear_checkpoint_dir

    step = tmp_path / "checkpoints" / "step_000003"
    (step / "policy").mkdir(parents=True)
    (step / "hf").mkdir()
    (step / "driver_state.json").write_text("{}")
    clear_checkpoint_dir(step)
    assert not step.exists()
    clear_checkpoint_dir(step)  # nothing there: nothing to do


def test_an_export_keeps_the_bases_tokenizer_and_pad_id_and_takes_a_dtype(tiny_model_dir, tmp_path):
    """A base whose tokenizer has no pad token: the job pads with EOS, and the export wrote that
    into the tokenizer and the generation config (pad 441 where the base said 439, in a trial);
    a bf16 base trained in float32 exported float32 only."""
    from slime.config import dump_config

    base = Path(shutil.copytree(tiny_model_dir, tmp_path / "base"))
    tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
    tokenizer_config.pop("pad_token", None)
    (base / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    special = base / "special_tokens_map.json"
    if special.is_file():
        special.write_text(json.dumps({k: v for k, v in json.loads(special.read_text()).items() if k != "pad_token"}))
    assert AutoTokenizer.from_pretrained(base).pad_token is None
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000001"
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).save_pretrained(checkpoint / "policy")
    (checkpoint / "driver_state.json").write_text(json.dumps({"next_step": 1}))
    dump_config(load_config(None, [f"model.path={base}"]), run / "config.yaml")
    out = export_checkpoint(find_checkpoint(run), tmp_path / "export", dtype="bfloat16")
    assert AutoTokenizer.from_pretrained(out).pad_token is None
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation.get("pad_token_id") == json.loads(
        (checkpoint / "policy" / "generation_config.json").read_text()
    ).get("pad_token_id")
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_an_export_of_a_checkpoint_pruned_while_it_is_read_is_one_line(tiny_model_dir, tmp_path, capsys):
    """A running job with checkpoint.keep_last deleted the checkpoint an export had chosen: a traceback."""
    from slime.config import dump_config

    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000004"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).save_pretrained(checkpoint / "policy")
    (checkpoint / "driver_state.json").write_text(json.dumps({"next_step": 4}))
    dump_config(load_config(None, [f"model.path={tiny_model_dir}"]), run / "config.yaml")
    real = export_module.load_checkpoint_policy

    def pruned_meanwhile(*args, **kwargs):
        model = real(*args, **kwargs)
        shutil.rmtree(checkpoint)  # what prune_checkpoints does, between the weights and the state
        return model

    export_module.load_checkpoint_policy = pruned_meanwhile
    try:
        code, _, err = _cli(capsys, "export", str(run), "--out", str(tmp_path / "out"))
    finally:
        export_module.load_checkpoint_policy = real
    assert code == 2 and "was deleted while it was read" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_lora_job_exports_its_adapters_for_peft_and_merged_for_transformers(tiny_model_dir, tmp_path, capsys):
    """learner.lora: `slime export` writes the adapters as a PEFT directory (PeftModel.from_pretrained
    on the base), `--merged` and checkpoint.export_hf the base with them merged; both give the same
    model, trained away from the base, and the engine's greedy tokens; `slime eval` scores it."""
    from peft import AutoPeftModelForCausalLM, PeftModel

    from slime.train import train

    run = tmp_path / "run"
    overrides = ["learner.lora.rank=8", "learner.lr=0.01", "checkpoint.export_hf=true", "steps=2"]
    train(load_config(None, ["cluster.launcher=local", "job_name=lora-export", f"output_dir={run}",
                             f"model.path={tiny_model_dir}", *TINY_JOB, *overrides]))  # fmt: skip
    checkpoint = find_checkpoint(run)
    assert (checkpoint / "adapter" / "adapter_config.json").is_file() and not (checkpoint / "policy").exists()
    code, out, err = _cli(capsys, "export", str(run), "--out", str(tmp_path / "adapter"))
    assert code == 0 and "PeftModel.from_pretrained" in out, err[-2000:]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapters = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(checkpoint / "hf", dtype=torch.float32)
    fresh_base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    moved = [n for n, t in merged.state_dict().items() if not torch.equal(t, fresh_base[n])]
    assert moved and all(".self_attn." in n for n in moved)  # only the adapted projections moved
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(with_adapters.state_dict()[name], tensor, rtol=0, atol=1e-6)
    # peft's auto class reads the task type from adapter_config.json (it was null: a ValueError).
    auto = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"), dtype=torch.float32).merge_and_unload()
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(auto.state_dict()[name], tensor, rtol=0, atol=1e-6)
    assert_greedy_tokens_match(checkpoint / "hf", merged, _prompts(AutoTokenizer.from_pretrained(checkpoint / "hf")))
    data = write_jsonl(repeat.make_dataset(8, seed=5), tmp_path / "held_out.jsonl")
    out = _eval_json(capsys, [str(run), "--data", str(data)])
    assert out["prompts"] == 8 and 0 <= out["greedy_reward_mean"] <= 1


def test_slime_eval_of_an_export_runs_in_the_precision_its_run_did(tiny_model_dir, tmp_path):
    """A bf16 run's export scored in float32 (slime eval dropped the run's model section, dtype too),
    so `slime eval EXPORT` and `slime eval RUN` gave different figures for one model."""
    from slime.config import dump_config
    from slime.evaluation import _job_config

    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "driver_state.json").write_text(json.dumps({"next_step": 1}))
    dump_config(load_config(None, [f"model.path={tiny_model_dir}", "model.dtype=bfloat16"]), checkpoint / "config.yaml")
    export = Path(shutil.copytree(tiny_model_dir, tmp_path / "export"))
    (export / "slime_export.json").write_text(json.dumps({"checkpoint": str(checkpoint)}))
    job, run_dir = _job_config(export, [])
    assert run_dir is None and job.model.path == str(export) and job.model.dtype == "bfloat16"
    assert _job_config(export, ["model.dtype=float32"])[0].model.dtype == "float32"  # yours wins
