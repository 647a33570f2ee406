"""What every config section shares: the strict base model, the error a bad config raises, and the
strict YAML reader of config files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from slime.errors import UserError


class StrictModel(BaseModel):
    """Unknown keys fail at load with their dotted path; assignments are validated too. No number may
    be inf or nan: no field means "unbounded" by inf, and learner.lr=inf trained NaN weights."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


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
