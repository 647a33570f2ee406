"""Command-line overrides, `section.key=value`, applied onto the YAML file's data before validation.

A mapping given to a section (`rollout={max_new_tokens: 7}`) is merged into what the file set,
key by key; it never replaces the section, which would silently drop the file's other keys. A key
given twice keeps the last value, as a wrapper script that appends the user's overrides expects,
with a warning naming both values.
"""

from __future__ import annotations

import logging
from typing import Any, get_args

import yaml
from pydantic import BaseModel

from slime.config.base import ConfigError, section_at, yaml_value
from slime.config.renames import RENAMED, conflict_error, renamed_key

log = logging.getLogger(__name__)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: its problem and the column it was found at."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None:
        return " ".join(str(exc).split())
    return problem if mark is None else f"{problem} at column {mark.column + 1}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`learner.lr=1e-5` -> (['learner', 'lr'], 1e-05). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml_value(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"override {text!r}: value is not valid YAML ({_yaml_problem(exc)}); quote the value, e.g. "
            f"'{key}=\"...\"' (double quotes inside the shell's single quotes; \\n in them is a newline)"
        ) from exc
    # YAML reads 1e-5 as a string; users mean a number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.split("."), value


def _merge(into: dict[str, Any], given: dict[str, Any]) -> None:
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _optional(root: type[BaseModel], path: list[str]) -> bool:
    """The section at `path` may be None (`learner.lora=` turns LoRA off)."""
    parent = section_at(root, tuple(path[:-1]))
    info = parent.model_fields.get(path[-1]) if parent is not None else None
    return info is not None and type(None) in get_args(info.annotation)


def apply_overrides(data: dict[str, Any], overrides: list[str], root: type[BaseModel]) -> dict[str, Any]:
    """`data` with each `key.path=value` set; an old key (slime/config/renames.py) sets its new place.
    `root` (the JobConfig) tells which keys are sections."""
    given: dict[tuple[str, ...], tuple[str, Any]] = {}  # path set -> (the key as written, value)
    for text in overrides:
        written, value = parse_override(text)
        path = renamed_key(written)
        dotted = ".".join(path)
        earlier = given.get(tuple(path))
        if earlier is not None and earlier[1] != value:
            if earlier[0] != ".".join(written):
                (old, old_value), (new, new_value) = sorted(
                    [earlier, (".".join(written), value)], key=lambda kv: kv[0] not in RENAMED
                )
                raise conflict_error(old, old_value, new, new_value)
            log.warning(
                "override %s is given twice (%r, then %r): the last one, %r, is used", dotted, earlier[1], value, value
            )
        given[tuple(path)] = (".".join(written), value)
        is_section = section_at(root, tuple(path)) is not None
        if is_section and not isinstance(value, dict) and not (value is None and _optional(root, path)):
            raise ConfigError(
                f"override {text!r}: {dotted} is a section, not a value; set its keys one by one "
                f"({dotted}.KEY=VALUE) or give a mapping ('{dotted}={{KEY: VALUE}}'), which is merged into the file's"
            )
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
            node = child
        if is_section and isinstance(value, dict) and isinstance(node.get(path[-1]), dict):
            _merge(node[path[-1]], value)
        else:
            node[path[-1]] = value
    return data
