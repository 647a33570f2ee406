"""Command-line overrides onto a YAML file: a mapping given to a section merges into the file's
section instead of dropping its other keys, a section given a plain value is refused with the
form that works, a key given twice keeps the last value and says so, and the load-time notes on
off-policy combinations that run but not as their names suggest."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from slime.config import ConfigError, load_config


@pytest.fixture()
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "rollout": {"batch_size": 3, "n_samples_per_prompt": 4, "max_new_tokens": 40},
                "algorithm": {"correction": {"name": "tis", "tis_cap": 3.0}},
                "learner": {"lr": 1e-4, "lora": {"rank": 8}},
            }
        )
    )
    return path


def test_a_mapping_given_to_a_section_merges_into_the_files_section(config_file: Path) -> None:
    cfg = load_config(config_file, ["rollout={max_new_tokens: 7}", "algorithm={correction: {tis_cap: 1.5}}"])
    assert cfg.rollout.max_new_tokens == 7
    assert (cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt) == (3, 4)  # the file's, not the defaults
    assert (cfg.algorithm.correction.name, cfg.algorithm.correction.tis_cap) == ("tis", 1.5)


@pytest.mark.parametrize("override", ["rollout=", "rollout=3", "algorithm.correction=", "april=true"])
def test_a_section_given_a_plain_value_is_refused_with_the_form_that_works(config_file: Path, override: str) -> None:
    section = override.split("=")[0]
    with pytest.raises(
        ConfigError, match=rf"{section} is a section, not a value; set its keys one by one \({section}\.KEY"
    ):
        load_config(config_file, [override])


def test_an_optional_section_given_nothing_is_turned_off(config_file: Path) -> None:
    assert load_config(config_file, []).learner.lora.rank == 8
    assert load_config(config_file, ["learner.lora="]).learner.lora is None
    assert load_config(config_file, ["learner.lora={alpha: 4.0}"]).learner.lora.rank == 8  # merged


def test_a_key_given_twice_keeps_the_last_value_and_warns(config_file: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="slime.config"):
        cfg = load_config(config_file, ["learner.lr=1e-5", "rollout.batch_size=2", "learner.lr=2e-5"])
    assert cfg.learner.lr == 2e-5
    twice = [r.getMessage() for r in caplog.records if "given twice" in r.getMessage()]
    assert twice == ["override learner.lr is given twice (1e-05, then 2e-05): the last one, 2e-05, is used"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slime.config"):
        load_config(config_file, ["learner.lr=1e-5", "learner.lr=1e-5"])  # the same value twice: harmless
    assert not [r for r in caplog.records if "given twice" in r.getMessage()]


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["april.enabled=true"], "APRIL's resumed partials"),
        (["mode=async", "max_staleness=2"], "in the async loop"),
    ],
)
def test_mask_stale_where_most_tokens_are_stale_warns(config_file: Path, caplog, overrides, said) -> None:
    with caplog.at_level(logging.WARNING, logger="slime.config"):
        load_config(config_file, [*overrides, "algorithm.correction.name=mask_stale"])
    messages = [r.getMessage() for r in caplog.records if "mask_stale" in r.getMessage()]
    assert len(messages) == 1 and said in messages[0] and "offpolicy_masked_share" in messages[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slime.config"):
        load_config(config_file, ["algorithm.correction.name=mask_stale"])  # plain sync: nothing is stale
    assert not [r for r in caplog.records if "mask_stale" in r.getMessage()]


def test_async_with_april_says_what_april_does_there(config_file: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="slime.config"):
        load_config(config_file, ["mode=async", "max_staleness=2", "april.enabled=true", "april.max_version_span=1"])
    messages = [r.getMessage() for r in caplog.records if "mode=async with april.enabled" in r.getMessage()]
    assert len(messages) == 1
    assert "nothing is aborted and resumed" in messages[0]
    assert "april.max_version_span: sync loop only, ignored here" in messages[0]
