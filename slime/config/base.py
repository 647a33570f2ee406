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


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (the last one silently won)."""

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.YAMLError(
                    f"key {key!r} is given twice in one mapping (lines {seen[key] + 1} and {key_node.start_mark.line + 1})"
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml_file(path: Path) -> Any:
    """A config file's YAML; ConfigError naming the file for text that is not UTF-8 or not valid YAML."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        loaded = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: no tags that run code
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if (values := _expanded_size(loaded, {})) > MAX_YAML_VALUES:
        raise ConfigError(f"{path}: its aliases (*name) expand to {values:.3g} values, over {MAX_YAML_VALUES}")
    return loaded


def _expanded_size(node: Any, memo: dict[int, int]) -> int:
    """How many values `node` holds once every alias is copied out (aliases share one object)."""
    if not isinstance(node, (dict, list)):
        return 1
    if id(node) not in memo:
        children = node.values() if isinstance(node, dict) else node
        memo[id(node)] = 1 + sum(_expanded_size(child, memo) for child in children)
    return memo[id(node)]
