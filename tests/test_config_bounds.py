"""Edge values of the job config that used to load and then misbehave (repro/walk_fields.py walks
every field): each is now refused at load, naming the key and the reason."""

from __future__ import annotations

import json
import re

import pytest

from slime.config import ConfigError, load_config

EXAMPLE = "examples/repeat_grpo.yaml"


def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, list(overrides))
    return str(info.value)


def test_overlong_buffer_must_leave_room_below_max_new_tokens():
    # With L_cache >= L_max the soft start is <= 0: every response was penalised (overlong_share 1.0).
    msg = _refused("rollout.max_new_tokens=16", "algorithm.overlong_buffer=16")
    assert "algorithm.overlong_buffer=16" in msg and "rollout.max_new_tokens=16" in msg
    assert load_config(EXAMPLE, ["rollout.max_new_tokens=16", "algorithm.overlong_buffer=15"])


def test_adaptive_clip_is_refused_where_its_approx_kl_is_always_zero():
    # One update per batch: pi_theta is pi_old when the loss runs, so approx_kl read 0 every step and
    # the adaptive clip only widened, to max_clip.
    msg = _refused("algorithm.adaptive_clip.enabled=true", "algorithm.correction.name=tis")
    assert "algorithm.adaptive_clip" in msg and "correction.name=tis" in msg and "always 0" in msg
    for fine in (
        ["algorithm.correction.name=behaviour_clip"],
        ["algorithm.correction.name=tis", "learner.ppo_epochs=2"],
    ):
        assert load_config(EXAMPLE, ["algorithm.adaptive_clip.enabled=true", *fine]).algorithm.adaptive_clip.enabled


@pytest.mark.parametrize(
    "override",
    [
        "learner.lr=inf",  # loaded, trained NaN weights, reward 0.000, exit 0
        "april.oversample=.inf",  # loaded, then OverflowError in april/scheduler.py at the first step
        "eval.pass_threshold=.nan",  # loaded; no response could ever pass
        "algorithm.kl_coef=inf",
        "reward.timeout_s=inf",
    ],
)
def test_no_number_is_inf_or_nan(override):
    key = override.split("=")[0]
    msg = _refused("april.enabled=true", override)
    assert key in msg and "finite" in msg


def test_april_oversample_is_bounded_as_the_dashboards_control():
    # april.oversample=1e6 loaded; the first step then wrote 2e6 groups into Redis one by one, ignoring
    # SIGTERM (killed after 10 minutes).
    assert "april.oversample" in _refused("april.enabled=true", "april.oversample=1e6")
    assert load_config(EXAMPLE, ["april.enabled=true", "april.oversample=16"]).april.oversample == 16
    msg = _refused("april.enabled=true", "rollout.batch_size=2", "april.oversample_groups=33")
    assert "april.oversample_groups=33" in msg and "rollout.batch_size=2" in msg
    assert load_config(EXAMPLE, ["april.enabled=true", "rollout.batch_size=2", "april.oversample_groups=32"])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        # Each loaded, then the job died with a raw traceback: the engine's request check
        # (temperature in [0, 100]), AdamW's constructor, the correction's constructor.
        ("rollout.temperature=150", "rollout.temperature"),
        ("eval.temperature=150", "eval.temperature"),
        ("learner.betas=[1.5, 0.999]", "learner.betas"),
        ("learner.betas=[0.9, -0.1]", "learner.betas"),
        ("algorithm.correction.icepop_band=[5, 0.5]", "algorithm.correction.icepop_band"),
        ("algorithm.correction.geo_band=[1.2, 2]", "algorithm.correction.geo_band"),
    ],
)
def test_values_the_engine_or_optimizer_refuse_fail_at_load(override, key):
    assert key in _refused(override)


def test_edge_values_that_still_load():
    cfg = load_config(
        EXAMPLE,
        ["rollout.temperature=100", "learner.betas=[0, 0.5]", "algorithm.correction.icepop_band=[1, 1]"],
    )
    assert cfg.rollout.temperature == 100 and cfg.learner.betas == (0, 0.5)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("rollout.max_new_tokens=129", "rollout.max_new_tokens=129"),
        # Loaded, trained, then every evaluation request failed with a raw ValueError (exit 1).
        ("eval.max_new_tokens=129", "eval.max_new_tokens=129"),
        # Loaded, then the first rollout request failed with a raw ValueError (exit 1).
        ("rollout.top_k=101", "rollout.top_k=101"),
    ],
)
def test_budgets_beyond_the_model_fail_at_start(tmp_path, override, named):
    from slime.data import check_context_fits

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": 128, "vocab_size": 100})
    )
    cfg = load_config(EXAMPLE, [override])
    with pytest.raises(ConfigError, match=re.escape(named)):
        check_context_fits(cfg, str(tmp_path))
    check_context_fits(load_config(EXAMPLE, ["eval.max_new_tokens=128", "rollout.top_k=100"]), str(tmp_path))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        # vLLM refused it in the worker's constructor under Ray: three restarts, then a traceback (exit 1)
        (["vllm.max_model_len=100000"], "vllm.max_model_len=100000 exceeds the model's context"),
        # every request failed in the worker thread with a raw ValueError
        (
            ["vllm.max_model_len=64", "rollout.max_new_tokens=96"],
            "rollout.max_new_tokens=96 exceeds vllm.max_model_len=64",
        ),
    ],
)
def test_a_vllm_context_that_cannot_hold_the_budgets_fails_at_start(tmp_path, overrides, named):
    from slime.data import check_context_fits

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": 128, "vocab_size": 100})
    )
    with pytest.raises(ConfigError, match=re.escape(named)):
        check_context_fits(load_config(EXAMPLE, ["rollout.engine=vllm", *overrides]), str(tmp_path))
    check_context_fits(load_config(EXAMPLE, ["rollout.engine=vllm", "vllm.max_model_len=128"]), str(tmp_path))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        # Each loaded and then died with a raw traceback: torch.device("abc") in the worker's
        # constructor (LocalActorDead), redis-py's URL parser (RuntimeError ... is not a Redis URL).
        ("rollout.device=abc", "rollout.device"),
        ("learner.device=gpu", "learner.device"),
        ("buffer.url=localhost:6379", "buffer.url"),
    ],
)
def test_devices_and_buffer_urls_are_checked_at_load(override, key):
    assert key in _refused(override)


def test_good_devices_and_buffer_urls_load():
    cfg = load_config(
        EXAMPLE, ["rollout.device=cuda:1", "learner.device=cuda", "buffer.url=redis+cluster://10.0.0.1:7000"]
    )
    assert cfg.rollout.device == "cuda:1" and cfg.buffer.url.startswith("redis+cluster://")


@pytest.mark.parametrize(
    "content, said",
    [
        (b"\xff\xfejob_name: x\n", r"cfg\.yaml: not UTF-8 text \(byte 0xff at offset 0\)"),
        (
            b"steps: 2\nrollout:\n  batch_size: 4\nsteps: 3\n",
            r"key 'steps' is given twice in one mapping \(lines 1 and 4\)",
        ),
        # nine levels of nine aliases: billions of nodes once expanded (it ran 60 s into 2 GB)
        (
            b"a: &a [x, x, x, x, x, x, x, x, x]\n"
            + b"".join(f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n".encode() for p, c in zip("abcdefgh", "bcdefghi")),
            r"cfg\.yaml: its aliases \(\*name\) expand to [0-9.e+]+ values, over 100000",
        ),
    ],
)
def test_a_config_file_that_is_not_text_repeats_a_key_or_explodes_its_aliases_is_refused(tmp_path, content, said):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=said):
        load_config(path)


def test_own_data_without_a_reward_fn_is_warned_about(caplog):
    """A job on one's own prompts that forgot reward.fn trained on the example task's reward
    (character overlap with the label) without a word."""
    load_config(None, ["data.path=/data/math.jsonl"])
    assert "data.path=/data/math.jsonl is set but reward.fn is not" in caplog.text
    caplog.clear()
    load_config(None, ["data.path=/data/math.jsonl", "reward.fn=envs.repeat:reward"])  # meant: said so
    load_config(None, [])  # the example task's own data
    assert caplog.text == ""


def test_num_cpus_with_a_clusters_address_is_refused_at_load():
    # It loaded, then ray.init refused it when joining: "num_cpus and num_gpus must not be provided".
    msg = _refused("cluster.num_cpus=2", "cluster.ray_address=auto")
    assert "cluster.num_cpus=2" in msg and "cluster.ray_address=auto" in msg
    assert load_config(EXAMPLE, ["cluster.num_cpus=2"]) and load_config(EXAMPLE, ["cluster.ray_address=auto"])
    assert load_config(EXAMPLE, ["cluster.num_cpus=2", "cluster.ray_address=local"])  # a Ray of its own


@pytest.mark.parametrize(
    "override",
    [
        "learner.micro_batch_size=99999999999999999999999",  # loaded; "Overflow when unpacking long long" mid-run
        "rollout.hang_timeout_s=1e30",  # loaded; OverflowError: timestamp out of range
        "buffer.reconnect_timeout_s=1e30",  # loaded; OverflowError in the retry's deadline
        "model.tiny.num_layers=100000000",  # loaded; the allocation failed after Redis and Ray were up
        "data.num_generated=100000000000",  # loaded; MemoryError after ~100 s
        "eval.num_prompts=100000000000",
        "rollout.num_workers=100000",  # loaded; "can't start new thread", the process aborted
        "rollout.batch_size=100000000",  # loaded; the first step never ended
        "reward.timeout_s=1e10",  # loaded; the reward watchdog thread died of OverflowError
        "job_name=" + "a" * 300,  # loaded; shm_open failed (the name is in the segment's)
    ],
)
def test_numbers_past_any_real_use_are_refused_at_load(override):
    key = override.split("=")[0]
    assert key in _refused(override)


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path):
    from slime.cli import main

    (tmp_path / "file").write_text("not a directory")
    assert main(["train", EXAMPLE, f"output_dir={tmp_path / 'file'}"]) == 2


def test_gspo_says_it_ignores_token_clips_set_to_other_values_only(caplog):
    """slime's --eps-clip reaches GSPO; here GSPO reads algorithm.gspo.*: a value set for the token
    clip is said to be unused, but not the defaults a run's own config.yaml writes out."""
    load_config(None, ["algorithm.name=gspo", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28"])
    assert "ignores" not in caplog.text
    load_config(None, ["algorithm.name=gspo", "algorithm.clip_low=0.1"])
    assert "algorithm.name=gspo ignores algorithm.clip_low" in caplog.text
