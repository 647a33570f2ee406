"""The `slime` command on bad input: one line naming the cause (and a hint of what to do), exit
code 2, no traceback; `--debug` or SLIME_DEBUG=1 gives the traceback. Each kind of user error is
tried through the CLI's main() as a user would meet it (the `slime_main` fixture); a real `slime`
process prints the one line, the --debug traceback and an unexpected error's traceback. The hints
point to things that exist (subcommands, docs pages, README sections)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from slime.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "repeat_grpo.yaml")


def slime(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slime.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def assert_one_clean_error(done: subprocess.CompletedProcess, cause: str) -> None:
    """Exit 2; our lines are `slime: <cause>` and at most a hint after it; no traceback."""
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    ours = [line for line in done.stderr.splitlines() if line.startswith(("slime:", "  hint:"))]
    assert 1 <= len(ours) <= 2 and ours[0].startswith("slime:"), done.stderr[-2000:]
    assert cause in ours[0], (cause, ours[0])


def test_config_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    args = ("train", EXAMPLE, "rollout.batchsize=3", f"output_dir={tmp_path}")
    done = slime(*args)
    assert_one_clean_error(done, "rollout.batchsize: unknown field")
    assert "`slime config" in done.stderr  # the hint says where the fields are
    debug = slime(*args, "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


def test_dataset_error(tmp_path, slime_main, monkeypatch):
    from slime.data import DatasetError

    done = slime_main("train", EXAMPLE, "data.path=/nope.jsonl", f"output_dir={tmp_path}")
    assert_one_clean_error(done, "dataset not found: /nope.jsonl")
    monkeypatch.setenv("SLIME_DEBUG", "1")  # the error itself, for its traceback
    with pytest.raises(DatasetError, match="dataset not found"):
        slime_main("train", EXAMPLE, "data.path=/nope.jsonl", f"output_dir={tmp_path}")


def test_prompts_that_fill_the_models_context_are_refused_at_start(tmp_path, slime_main):
    """The tiny MoE reads 512 positions; prompts of 600 characters (tokens) left no room for a response: the
    job ran to the end on empty responses (truncated_share 1.0, nothing trained) without a word."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": "ab" * 300 + "=", "label": "ab"}) + "\n" for _ in range(4)))
    done = slime_main(
        "train",
        EXAMPLE,
        f"data.path={data}",
        "data.max_prompt_tokens=2000",
        "reward.fn=envs.repeat:reward",
        f"output_dir={tmp_path / 'run'}",
    )
    assert_one_clean_error(done, "4 of 4 prompts (the longest 601 tokens) fill the model's context")
    assert "max_position_embeddings=512" in done.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_plugin_with_a_syntax_error(tmp_path, slime_main):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def score(prompt, response:\n    return 1\n")
    done = slime_main("train", EXAMPLE, f"reward.fn={bad}:score", f"output_dir={tmp_path / 'run'}")
    assert_one_clean_error(done, "SyntaxError")
    assert str(bad) in done.stderr


def test_reward_spec_error(tmp_path, slime_main):
    done = slime_main("train", EXAMPLE, "reward.fn={mix: 3}", f"output_dir={tmp_path}")
    assert_one_clean_error(done, "invalid reward spec: reward.mix")


@pytest.mark.slow
def test_checkpoint_error(tmp_path, slime_main):
    done = slime_main("train", EXAMPLE, f"resume={tmp_path}", f"output_dir={tmp_path / 'run'}")
    assert_one_clean_error(done, "not a checkpoint directory")


@pytest.mark.slow
def test_resource_error(tmp_path, slime_main):
    done = slime_main("train", EXAMPLE, "learner.cpus_per_rank=512", f"output_dir={tmp_path}")
    assert_one_clean_error(done, "CPU: needs 512")


@pytest.mark.slow
def test_cluster_error(tmp_path):
    # An address Ray cannot parse fails at once (`auto` would join any Ray running on this machine,
    # such as the test session's, and a closed port waits a minute for a GCS).
    address = "127.0.0.1:notaport"
    done = slime("train", EXAMPLE, f"cluster.ray_address={address}", f"output_dir={tmp_path}", env={"RAY_ADDRESS": ""})
    assert_one_clean_error(done, f"cluster.ray_address={address}: Ray could not start or join")


def test_an_unexpected_exception_keeps_its_traceback(tmp_path, slime_main):
    broken = tmp_path / "broken_reward.py"
    broken.write_text("raise RuntimeError('not a user error')\n")  # fails at import: a PluginError
    done = slime_main("train", EXAMPLE, f"reward.fn={broken}:score", f"output_dir={tmp_path / 'run'}")
    assert_one_clean_error(done, "not a user error")  # wrapped: the plugin names the file
    code = "import slime.cli as c; c._run = lambda argv: 1 / 0; raise SystemExit(c.main(['train']))"
    crash = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert crash.returncode == 1 and "Traceback" in crash.stderr and "ZeroDivisionError" in crash.stderr


def _all_user_errors() -> list[type[UserError]]:
    for module in ("slime.config", "slime.data", "slime.job", "rewards.mix", "rewards.adapters", "envs.sandbox"):
        importlib.import_module(module)
    found, todo = [], [UserError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [cls for cls in found if cls is not UserError]


def test_every_hint_points_to_what_exists():
    from slime.cli import main

    readme = (ROOT / "README.md").read_text()
    errors = _all_user_errors()
    assert len(errors) >= 9  # config, dataset, plugin, reward spec and signature, checkpoint, resources, cluster, ...
    for cls in errors:
        assert cls.hint, f"{cls.__name__} has no hint"
        for page in re.findall(r"docs/[\w./-]+\.md", cls.hint):
            assert (ROOT / page).is_file(), (cls.__name__, page)
        for section in re.findall(r"README, '([^']+)'", cls.hint):
            assert f"## {section}" in readme, (cls.__name__, section)
        for command in re.findall(r"`slime ([\w-]+)", cls.hint):
            with pytest.raises(SystemExit) as shown:
                main([command, "--help"])
            assert shown.value.code == 0, (cls.__name__, command)


def test_an_empty_stop_string(tmp_path, slime_main):
    """Checked against the tokenizer before any worker starts (a string of several tokens is fine:
    it is matched in the response's text)."""
    done = slime_main("train", EXAMPLE, "rollout.stop=['']", "cluster.launcher=local", f"output_dir={tmp_path}")
    assert_one_clean_error(done, "rollout.stop: '' is no token at all (an empty stop string)")


def test_a_flag_where_an_override_goes_is_said_as_the_override(capsys):
    from slime.cli import main

    for args, said in [
        (["--steps", "3"], "unrecognized arguments: --steps 3; config overrides are key=value, e.g. steps=3"),
        (["--rollout.batch-size=4"], "config overrides are key=value, e.g. rollout.batch_size=4"),
    ]:
        with pytest.raises(SystemExit) as caught:
            main(["train", EXAMPLE, *args])
        assert caught.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "override"),
    [
        (["--rollout-batch-size", "8"], "rollout.batch_size=8"),  # slime's flag; rollout_batch_size is no key
        (["--n-samples-per-prompt=8"], "rollout.n_samples_per_prompt=8"),  # the one key of that name
        (["--lr", "1e-6"], "learner.lr=1e-6"),  # the shallowest of learner.lr and model.warmstart.lr
        (["--checkpoint-every", "5"], "checkpoint.every_steps=5"),  # an old key's new place (config/renames.py)
        (["--batch-size", "3"], "rollout.batch_size=3 or reward.batch_size=3"),  # ambiguous: each key
    ],
)
def test_a_slime_flag_is_said_as_an_override_that_loads(capsys, args, override):
    from slime.cli import main
    from slime.config import load_config

    with pytest.raises(SystemExit) as caught:
        main(["train", EXAMPLE, *args])
    assert caught.value.code == 2
    assert f"config overrides are key=value, e.g. {override}\n" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new key itself, not an old one read for a release
        for said in override.split(" or "):
            load_config(EXAMPLE, [said])


def test_a_flag_no_config_key_fits_gets_the_overrides_form_not_a_key_that_fails(capsys):
    from slime.cli import main

    with pytest.raises(SystemExit):
        main(["train", EXAMPLE, "--rollout-speed", "64"])
    said = capsys.readouterr().err
    assert "config overrides are section.key=value (e.g. learner.lr=1e-5), and no config key is named " in said
    assert "rollout_speed: `slime config` prints every key" in said and "rollout_speed=64" not in said


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--global-batch-size", "64"], "--global-batch-size is THUDM slime's flag; here: learner.num_minibatches ="),
        (["--eps-clip=0.2"], "--eps-clip is THUDM slime's flag; here: algorithm.clip_low"),
        (["num_rollout=3"], "num_rollout: unknown field (--num-rollout is THUDM slime's flag; here: steps"),
    ],
)
def test_a_slime_flag_with_no_key_of_its_name_says_what_to_write_here(capsys, args, said):
    from slime.cli import main

    with pytest.raises(SystemExit) if args[0].startswith("--") else contextlib.nullcontext():
        assert main(["train", EXAMPLE, *args]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("rollout.n_sample_per_prompt=8", "rollout.n_samples_per_prompt"),  # a typo: the closest of its section
        ("rollout.batchsize=3", "rollout.batch_size"),
        ("rollout_batch_size=8", "rollout.batch_size"),  # slime's name for it
        ("rollout.lr=1e-6", "learner.lr"),  # a key of another section
    ],
)
def test_an_unknown_key_names_the_key_meant(override, meant):
    from slime.config import ConfigError, load_config

    written, value = override.split("=")
    with pytest.raises(ConfigError, match=re.escape(f"{written}: unknown field (did you mean {meant}?)")):
        load_config(EXAMPLE, [override])
    assert load_config(EXAMPLE, [f"{meant}={value}"])  # the key said loads


def test_an_unknown_key_in_a_yaml_file_names_the_key_meant_and_none_is_made_up(tmp_path):
    from slime.config import ConfigError, load_config

    path = tmp_path / "job.yaml"
    path.write_text("rollout:\n  n_sample_per_prompt: 8\n")
    with pytest.raises(ConfigError, match=re.escape("unknown field (did you mean rollout.n_samples_per_prompt?)")):
        load_config(path)
    # nothing close, or inside a list's item (no dotted key stands there): the spelling, no guess
    for override in ["zzz=1", "sampling.curriculum=[{name: a, nmae: b}]"]:
        with pytest.raises(ConfigError, match=re.escape("unknown field (check the spelling)")):
            load_config(EXAMPLE, [override])


@pytest.mark.parametrize(
    ("config", "cause"),
    [(None, "no such directory"), ({"hidden_size": 8}, "config.json has no model_type")],
)
def test_a_model_path_that_is_no_model(tmp_path, config, cause, slime_main):
    """model.path without a config.json, or with one transformers cannot read: one line naming
    model.path and the cause, before anything starts."""
    model = tmp_path / "model"
    if config is not None:
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
    done = slime_main("train", EXAMPLE, f"model.path={model}", "steps=1", f"output_dir={tmp_path / 'run'}")
    assert_one_clean_error(done, f"model.path={model}: ")
    assert cause in done.stderr


def test_a_user_error_raised_in_a_ray_actor_is_reported_without_rays_trace(capsys):
    """The error of a Ray actor's call comes back as Ray's RayTaskError(CheckpointError), whose text
    is Ray's: the actor's repr, pid and ~15 lines of frames before the one line that says what to do."""
    from ray.exceptions import RayTaskError

    from slime.cli import _report
    from slime.errors import user_error_behind
    from slime.learner.sharding import CheckpointError

    cause = CheckpointError("the checkpoint holds LoRA adapters (adapter/), but learner.lora is not set")
    trace = 'ray::Learner.load() (pid=4652, ip=10.0.0.1)\n  File "actor.py", line 1\nCheckpointError: ...'
    raised = RayTaskError("Learner.load", trace, cause).as_instanceof_cause()
    assert isinstance(raised, CheckpointError)
    assert _report(user_error_behind(raised)) == 2  # as main() reports it
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"slime: {cause}"
    assert "pid=" not in err and "File" not in err


def test_a_full_disk_is_one_line_naming_where_and_leaves_no_partial_file(tmp_path, monkeypatch):
    """A resume on a full disk died with a traceback ending in 'Errno 28' from write_private, and left
    an empty .job.secret.PID.tmp in the run directory."""
    import errno
    import os

    from slime.errors import DiskFullError, user_error_of
    from slime.security import write_private

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as info:
        write_private(tmp_path / "job.secret", "s3cret")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    wrapped = RuntimeError("starting the job failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "job.secret"))
    for exc in (info.value, wrapped):
        user = user_error_of(exc)
        assert isinstance(user, DiskFullError) and "no space left on the device of" in str(user)
    assert str(tmp_path / "job.secret") in str(user_error_of(wrapped))
    assert user_error_of(OSError(errno.EACCES, "denied")) is None  # other OS errors keep their traceback


def test_a_sampling_mistake_is_one_line_and_leaves_the_earlier_run_where_it_was(tmp_path, tiny_model_dir, slime_main):
    """A curriculum stage that matches no prompt raised a traceback (exit 1), after the earlier run in
    the output_dir had been moved to earlier_runs/1."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    done = slime_main(
        "train",
        EXAMPLE,
        f"output_dir={run}",
        f"model.path={tiny_model_dir}",
        "sampling.curriculum=[{name: a, filter: {levle: 0}}]",
    )
    assert_one_clean_error(done, "sampling.curriculum stage 'a'")
    assert (run / "metrics.jsonl").exists() and not (run / "earlier_runs").exists()
