"""What every config section shares: the strict base model, the error a bad config raises, and the
strict YAML reader of config files."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict

from slime.errors import UserError


class StrictModel(BaseModel):
    """Unknown keys fail at load with their dotted path; assignments are validated too. No number may
    be inf or nan: no field means "unbounded" by inf, and learner.lr=inf trained NaN weights."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a field that is a section (`X` or `X | None`); None for any other field."""
    kinds = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    kinds = tuple(k for k in kinds if k is not type(None))
    if len(kinds) == 1 and isinstance(kinds[0], type) and issubclass(kinds[0], BaseModel):
        return kinds[0]
    return None


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of `model`: each field, and a section's own fields under its name."""
    paths = []
    for name, info in model.model_fields.items():
        paths.append(prefix + name)
        section = section_model(info.annotation)
        if section is not None:
            paths.extend(field_paths(section, f"{prefix}{name}."))
    return paths


def section_at(model: type[BaseModel], path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The section that `path` (a pydantic error's location) names; None inside a list or a mapping."""
    section: type[BaseModel] | None = model
    for part in path:
        info = section.model_fields.get(part) if isinstance(part, str) else None
        section = section_model(info.annotation) if info is not None else None
        if section is None:
            return None
    return section


class ConfigError(UserError, ValueError):
    """A configuration that cannot run; the message names the field and the reason."""

    hint = "`slime config [CONFIG.yaml] [key=value ...]` prints every field with the value it would take"


# The device types torch.device parses (its own error lists them), optionally with an index.
DEVICE_PATTERN = re.compile(
    r"^(cpu|cuda|ipu|xpu|mkldnn|opengl|opencl|ideep|hip|ve|fpga|maia|xla|lazy|vulkan|mps|meta|hpu|mtia|privateuseone)"
    r"(:[0-9]+)?$"
)


def check_device(value: str) -> str:
    """A device field's value (rollout.device, learner.device): what torch.device takes."""
    if not DEVICE_PATTERN.match(value):
        raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:N, ...)")
    return value


MAX_YAML_VALUES = 100_000  # far more than any config holds; nested aliases expand to billions


def load_yaml_file(path: Path) -> Any:
    """A config file's YAML (safe_load), refused with ConfigError naming the file when it is not
    UTF-8 or not valid YAML, gives a key twice in one mapping (the last one silently won), or has
    aliases that expand past MAX_YAML_VALUES values."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)  # the node graph: nothing constructed yet
        values = _checked_size(root, {}) if root is not None else 0
        if values > MAX_YAML_VALUES:
            raise _Refused(f"its aliases (*name) expand to {values:.3g} values, over {MAX_YAML_VALUES}")
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    except _Refused as exc:
        raise ConfigError(f"{path}: {exc}") from None


class _Refused(Exception):
    """Valid YAML that a config file must not be."""


def _checked_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """How many values `node` holds once every alias is copied out (an alias is the same node,
    counted once per use but walked once); raises on a mapping that gives a key twice."""
    if id(node) in memo:
        return memo[id(node)]
    size = 1
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value in lines:
                raise _Refused(
                    f"key {key.value!r} is given twice in one mapping (lines {lines[key.value] + 1} and "
                    f"{key.start_mark.line + 1})"
                )
            if isinstance(key, yaml.ScalarNode):
                lines[key.value] = key.start_mark.line
            size += _checked_size(key, memo) + _checked_size(value, memo)
    elif isinstance(node, yaml.SequenceNode):
        size += sum(_checked_size(child, memo) for child in node.value)
    memo[id(node)] = size
    return size
