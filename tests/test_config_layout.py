"""Issue 32, config by reader: moved keys load with a warning naming their new place, old and new
at once conflict, one seed, one loop mode, one resolution of the "auto" weight transport, and a
run's config.yaml written before the move still loads with the same values."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from slime.config import (
    RENAMED,
    ConfigError,
    ConfigKeyDeprecated,
    JobConfig,
    config_for_display,
    load_config,
    resolve_weight_transport,
)

DATA = Path(__file__).parent / "data"

# A value of each old key that differs from its default, so that it visibly lands in its new place.
OLD_VALUES = {
    "april.off_policy": "tis",
    "april.clip_band_per_version": False,
    "april.tis_cap": 1.5,
    "april.icepop_band": [0.6, 4.0],
    "april.geo_band": [0.7, 1.5],
    "april.m2po_threshold": 0.05,
    "april.opsm_delta": 0.2,
    "algorithm.gspo_clip_low": 1e-4,
    "algorithm.gspo_clip_high": 2e-4,
    "algorithm.cispo_clip_high": 0.5,
    "algorithm.dr_grpo_norm_tokens": 64,
    "checkpoint_every": 5,
    "checkpoint_every_seconds": 60.0,
}


def _get(cfg: JobConfig, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return list(node) if isinstance(node, tuple) else node


def _nested(dotted: str, value) -> dict:
    out: dict = {}
    node = out
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def test_every_moved_key_is_covered() -> None:
    assert set(OLD_VALUES) == set(RENAMED)


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_old_key_in_an_override_warns_and_lands_in_its_new_place(old: str) -> None:
    new = RENAMED[old]
    value = OLD_VALUES[old]
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: it is now {new}\b"):
        cfg = load_config(None, [f"{old}={value}"])
    assert _get(cfg, new) == value


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_old_key_in_a_yaml_file_warns_and_lands_in_its_new_place(old: str, tmp_path: Path) -> None:
    new = RENAMED[old]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_nested(old, OLD_VALUES[old])))
    with pytest.warns(ConfigKeyDeprecated, match=rf"{old} is deprecated: it is now {new}\b"):
        cfg = load_config(path)
    assert _get(cfg, new) == OLD_VALUES[old]
    assert "off_policy" not in config_for_display(cfg)["april"]  # written back under the new key only


def test_new_keys_load_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(None, [f"{new}={OLD_VALUES[old]}" for old, new in RENAMED.items()])
    assert all(_get(cfg, new) == OLD_VALUES[old] for old, new in RENAMED.items())


def test_old_and_new_at_once_with_different_values_name_both(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("april:\n  off_policy: tis\nalgorithm:\n  correction:\n    name: icepop\n")
    with (
        pytest.warns(ConfigKeyDeprecated),
        pytest.raises(ConfigError, match="april.off_policy.*algorithm.correction.name"),
    ):
        load_config(path)
    with (
        pytest.warns(ConfigKeyDeprecated),
        pytest.raises(ConfigError, match="algorithm.gspo_clip_low.*algorithm.gspo.clip_low"),
    ):
        load_config(None, ["algorithm.gspo.clip_low=1e-4", "algorithm.gspo_clip_low=2e-4"])
    # the same value twice is only redundant; an override of the old key still beats the file's new key
    with pytest.warns(ConfigKeyDeprecated):
        assert (
            load_config(None, ["april.tis_cap=1.5", "algorithm.correction.tis_cap=1.5"]).algorithm.correction.tis_cap
            == 1.5
        )
    path.write_text("algorithm:\n  correction:\n    name: icepop\n")
    with pytest.warns(ConfigKeyDeprecated):
        assert load_config(path, ["april.off_policy=tis"]).algorithm.correction.name == "tis"


def test_model_validate_moves_old_keys_too() -> None:
    with pytest.warns(ConfigKeyDeprecated, match="algorithm.cispo.clip_high"):
        cfg = JobConfig.model_validate({"algorithm": {"cispo_clip_high": 0.4}})
    assert cfg.algorithm.cispo.clip_high == 0.4


@pytest.mark.parametrize("name", ["default", "repeat_april"])
def test_a_runs_config_yaml_from_before_the_move_loads_with_the_same_values(name: str) -> None:
    """The files are what `dump_config` wrote before issue 32 (tests/data/config_before_issue32_*)."""
    before = DATA / f"config_before_issue32_{name}.yaml"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(before)
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert sorted(said) == sorted(
        f"config key {o} is deprecated: it is now {n} (the old key is read for one release)" for o, n in RENAMED.items()
    )
    fresh = load_config(None if name == "default" else Path(__file__).parents[1] / "examples" / "repeat_april.yaml")
    # written as false before the default became None (unset): the same for text prompts
    assert cfg.data.apply_chat_template is False and fresh.data.apply_chat_template is None
    cfg.data.apply_chat_template = None
    assert config_for_display(cfg) == config_for_display(fresh)
    old = yaml.safe_load(before.read_text())
    for old_key, new_key in RENAMED.items():
        *section, leaf = old_key.split(".")  # checkpoint_every was a root key
        assert _get(cfg, new_key) == (old[section[0]] if section else old)[leaf]
    assert (cfg.seed, cfg.model.seed, cfg.data.seed) == (old["seed"], old["model"]["seed"], old["data"]["seed"])


def test_one_seed_derives_model_and_data_seeds_unless_set() -> None:
    cfg = load_config()
    assert (cfg.seed, cfg.model.seed, cfg.data.seed) == (0, 0, 0)  # as before: all three were 0
    cfg = load_config(None, ["seed=7"])
    assert (cfg.model.seed, cfg.data.seed) == (7, 7)
    cfg = load_config(None, ["seed=7", "data.seed=3", "model.seed=0"])
    assert (cfg.model.seed, cfg.data.seed) == (0, 3)
    cfg = load_config(None, ["seed=7"])
    cfg.seed = 9  # a derived seed follows a later assignment, an explicit one does not
    assert (cfg.model.seed, cfg.data.seed) == (9, 9)


def test_loop_mode_is_worked_out_in_one_place() -> None:
    assert load_config().loop_mode == "sync"
    assert load_config(None, ["april.enabled=true"]).loop_mode == "sync"
    assert load_config(None, ["mode=async"]).loop_mode == "async"
    streaming = ["algorithm.name=ppo", "april.streaming_chunk_tokens=8"]
    assert load_config(None, streaming).loop_mode == "streaming"


@pytest.mark.parametrize(
    ("kind", "device", "resolved"),
    [("auto", "cpu", "shm"), ("auto", "cuda", "cuda_ipc"), ("auto", "cuda:1", "cuda_ipc"), ("file", "cuda", "file")],
)
def test_auto_weight_transport_resolves_in_one_place(kind: str, device: str, resolved: str) -> None:
    assert resolve_weight_transport(kind, device) == resolved
    cfg = load_config(None, [f"weights.transport={kind}", f"learner.device={device}"])
    assert cfg.weight_transport == resolved


def test_no_two_classes_are_called_adaptive_clip() -> None:
    root = Path(__file__).parents[1] / "slime"
    hits = [
        p
        for p in root.rglob("*.py")
        if "class AdaptiveClip(" in p.read_text() or "class AdaptiveClip:" in p.read_text()
    ]
    assert [p.relative_to(root).as_posix() for p in hits] == ["algorithms/schedules.py"]
