"""Keys that moved (issue 32: config grouped by reader; issue 37: the checkpoint section). An old key still loads, from a YAML file,
a run's own config.yaml or a `key=value` override, with a `ConfigKeyDeprecated` warning naming
its new place; this release only. Old and new set to different values is a ConfigError.
`flat_keys`, `suggested_key` and `unknown_field` name the key a user most likely meant (a slime flag, a typo)."""

from __future__ import annotations

import copy
import difflib
import warnings
from typing import Any

from pydantic import BaseModel

from slime.config.base import ConfigError, field_paths, section_at

_CORRECTION_KEYS = ("clip_band_per_version", "tis_cap", "icepop_band", "geo_band", "m2po_threshold", "opsm_delta")

# old dotted key -> new dotted key
RENAMED: dict[str, str] = {
    "april.off_policy": "algorithm.correction.name",
    **{f"april.{k}": f"algorithm.correction.{k}" for k in _CORRECTION_KEYS},
    "algorithm.gspo_clip_low": "algorithm.gspo.clip_low",
    "algorithm.gspo_clip_high": "algorithm.gspo.clip_high",
    "algorithm.cispo_clip_high": "algorithm.cispo.clip_high",
    "algorithm.dr_grpo_norm_tokens": "algorithm.dr_grpo.norm_tokens",
    # issue 37: the checkpoint's settings in one section, beside checkpoint.export_hf
    "checkpoint_every": "checkpoint.every_steps",
    "checkpoint_every_seconds": "checkpoint.every_seconds",
}


# THUDM slime's flags (underscored) whose name is not a key here: what to write instead. Flags that
# match a key's name (`rollout_batch_size`, `n_samples_per_prompt`, `label_key`, ...) need no entry.
SLIME_FLAGS: dict[str, str] = {
    "num_rollout": "steps (training steps, one rollout each)",
    "global_batch_size": "learner.num_minibatches = rollout.batch_size x rollout.n_samples_per_prompt / global_batch_size",
    "num_steps_per_rollout": "learner.num_minibatches (optimizer steps per rollout)",
    "partial_rollout": "april.enabled=true (aborted partials resume in a later step)",
    "over_sampling_batch_size": "april.oversample_groups (groups kept in flight, >= rollout.batch_size; with april.enabled=true)",
    "dynamic_sampling_filter_path": "april.group_filter=path.py:function (or april.filter_zero_variance=true)",
    "custom_rm_path": "reward.fn=path.py:function (slime's `async def rm(args, sample)` loads as it is)",
    "rm_type": "reward.fn (e.g. rewards.rule:math_answer), or a dataset column rm_type that a slime reward reads",
    "custom_generate_function_path": "env.plugin (a multi-turn env: reset/step; docs/environments.md)",
    "eps_clip": "algorithm.clip_low",
    "eps_clip_high": "algorithm.clip_high",
    "use_kl_loss": "algorithm.kl_coef > 0 (algorithm.kl_mode=loss, the default)",
    "kl_loss_coef": "algorithm.kl_coef",
    "kl_loss_type": "algorithm.kl_estimator",
    "advantage_estimator": "algorithm.name (grpo, ppo, reinforce_pp, gspo, ...)",
    "rollout_max_response_len": "rollout.max_new_tokens",
    "input_key": "data.prompt_key",
    "save": "output_dir (checkpoints go to output_dir/checkpoints)",
    "load": "resume=PATH (a checkpoint), or resume=auto",
    "save_interval": "checkpoint.every_steps",
    "hf_checkpoint": "model.path (a local Hugging Face directory)",
    "calculate_per_token_loss": "algorithm.loss_agg=token_mean (the default here; slime's default is seq_mean_token_mean)",
    "debug_rollout_only": "nothing alike: `slime eval` generates and scores without training",
    "debug_train_only": "`slime replay RUN_DIR [key=value ...]`: a fresh learner on a finished run's batches",
    "load_debug_rollout_data": "`slime replay RUN_DIR`: the run's buffer holds its rollouts",
}


# verl's config keys (its trainer YAML's leaf names) whose name is not a key here: what to write
# instead. docs/learner.md has the whole table.
VERL_KEYS: dict[str, str] = {
    "adv_estimator": "algorithm.name (gae: ppo; grpo, rloo, reinforce_plus_plus: reinforce_pp, ...)",
    "norm_adv_by_std_in_grpo": "algorithm.grpo_std_normalize (or algorithm.name=dr_grpo)",
    "clip_ratio": "algorithm.clip_low and algorithm.clip_high",
    "clip_ratio_low": "algorithm.clip_low",
    "clip_ratio_high": "algorithm.clip_high",
    "clip_ratio_c": "algorithm.dual_clip (off unless set; verl applies 3.0)",
    "cliprange_value": "algorithm.value_clip",
    "loss_agg_mode": "algorithm.loss_agg (token_mean, seq_mean_token_sum, seq_mean_token_mean)",
    "entropy_coeff": "algorithm.entropy_coef",
    "use_kl_loss": "algorithm.kl_coef > 0 with algorithm.kl_mode=loss (the default)",
    "kl_loss_coef": "algorithm.kl_coef",
    "kl_loss_type": "algorithm.kl_estimator (k1, k2, k3, low_var_kl)",
    "use_kl_in_reward": "algorithm.kl_mode=reward (PPO; REINFORCE++ always)",
    "kl_ctrl": "algorithm.kl_coef, algorithm.kl_target and algorithm.kl_horizon",
    "ppo_mini_batch_size": "learner.num_minibatches = samples per step / mini-batch size",
    "ppo_micro_batch_size_per_gpu": "learner.micro_batch_size",
    "ppo_max_token_len_per_gpu": "learner.max_tokens_per_micro_batch",
    "critic_warmup": "learner.critic_warmup_steps",
    "train_batch_size": "rollout.batch_size (prompts per step)",
    "max_response_length": "rollout.max_new_tokens",
    "max_prompt_length": "data.max_prompt_tokens",
    "total_training_steps": "steps",
    "filter_groups": "april.filter_zero_variance=true (or april.group_filter=path.py:function)",
    "overlong_buffer_len": "algorithm.overlong_buffer",
    "actor_rollout_ref": "the sections model, rollout and learner (docs/learner.md maps verl's keys)",
    "trainer": "steps, output_dir, checkpoint.every_steps, logging.* (docs/learner.md maps verl's keys)",
}


def slime_flag_hint(name: str) -> str | None:
    """For one of THUDM slime's flags that is no key here: `--flag` is slime's; write ... instead."""
    meant = SLIME_FLAGS.get(name.lstrip("-").replace("-", "_"))
    return f"--{name.lstrip('-').replace('_', '-')} is THUDM slime's flag; here: {meant}" if meant else None


def flat_keys(name: str, model: type[BaseModel]) -> list[str]:
    """The dotted keys of `model` a flat name may stand for, as slime's flags and old configs write
    keys (`rollout-batch-size`, `checkpoint_every`, `lr`): an old key's new place, the key itself,
    its dots written as `_`, else the shallowest keys ending in it (several: the name is ambiguous)."""
    name = name.replace("-", "_")
    if name in RENAMED:
        return [RENAMED[name]]
    keys = field_paths(model)
    for fits in (lambda k: k == name, lambda k: k.replace(".", "_") == name, lambda k: k.rpartition(".")[2] == name):
        found = [k for k in keys if fits(k)]
        if found:
            depth = min(k.count(".") for k in found)
            return [k for k in found if k.count(".") == depth]
    return []


def flat_key(name: str, model: type[BaseModel]) -> str | None:
    """The one dotted key a flat name stands for (`flat_keys`); None when none or several fit."""
    keys = flat_keys(name, model)
    return keys[0] if len(keys) == 1 else None


def suggested_key(model: type[BaseModel], loc: tuple[str | int, ...]) -> str | None:
    """What the unknown key at `loc` (a pydantic error's location) most likely meant: a flat name's
    key (`rollout_batch_size`: rollout.batch_size), else the closest field of its section (a typo)."""
    section = section_at(model, loc[:-1])
    if section is None:
        return None
    leaf = str(loc[-1])
    near = difflib.get_close_matches(leaf, list(section.model_fields), n=1)
    return flat_key(leaf, model) or (".".join([*map(str, loc[:-1]), near[0]]) if near else None)


def unknown_field(model: type[BaseModel] | None, loc: tuple[str | int, ...], prefix: str = "") -> str:
    """The message of an unknown key at `loc`: with the key it most likely meant, when `model` is given."""
    if len(loc) == 1 and (slime := slime_flag_hint(str(loc[0]))):
        return f"unknown field ({slime})"
    if (leaf := str(loc[-1])) in VERL_KEYS:
        return f"unknown field ({leaf} is verl's key; here: {VERL_KEYS[leaf]})"
    meant = suggested_key(model, loc) if model is not None else None
    return f"unknown field (did you mean {prefix}{meant}?)" if meant else "unknown field (check the spelling)"


class ConfigKeyDeprecated(DeprecationWarning):
    """A config key that moved; the CLI shows these (Python hides DeprecationWarning by default)."""


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"config key {old} is deprecated: it is now {new} (the old key is read for one release)",
        ConfigKeyDeprecated,
        stacklevel=stacklevel + 1,
    )


def conflict_error(old: str, old_value: Any, new: str, new_value: Any) -> ConfigError:
    return ConfigError(
        f"{old}={old_value!r} and {new}={new_value!r} are both set: {old} is the old name of {new}; keep only {new}"
    )


def renamed_key(path: list[str]) -> list[str]:
    """The new path of a moved key (with its warning); any other path unchanged."""
    old = ".".join(path)
    new = RENAMED.get(old)
    if new is None:
        return path
    _warn(old, new, 4)  # load_config's caller: load_config -> apply_overrides -> here
    return new.split(".")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _section(data: dict[str, Any], parts: list[str]) -> Any:
    node: Any = data
    for part in parts:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def move_renamed_keys(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (a config as plain data) with every old key moved to its new place, each warned of."""
    present = [
        old for old in RENAMED if isinstance(s := _section(data, old.split(".")[:-1]), dict) and old.split(".")[-1] in s
    ]
    if not present:
        return data
    data = copy.deepcopy(data)
    for old in present:
        *old_parents, old_leaf = old.split(".")
        new = RENAMED[old]
        *new_parents, new_leaf = new.split(".")
        value = _section(data, old_parents).pop(old_leaf)
        _warn(old, new, 3)  # load_config's caller
        node = data
        for part in new_parents:
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{old}: cannot move it to {new}, {part} is not a section")
            node = child
        if new_leaf in node and _plain(node[new_leaf]) != _plain(value):
            raise conflict_error(old, value, new, node[new_leaf])
        node[new_leaf] = value
    return data
