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
MAX_YAML_DEPTH = 100  # levels of lists and mappings, aliases expanded; a config holds a handful

# YAML 1.1's base-60 numbers (`1:30` read as 90, `1:30.5` as 90.5): kept as the text they are, so a
# number field refuses them by name instead of taking a value nobody wrote.
_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")


def load_yaml_file(path: Path) -> Any:
    """A config file's YAML (safe_load, less base-60 numbers), refused with ConfigError naming the
    file when it is not UTF-8 or not valid YAML, gives a key twice in one mapping (the last one
    silently won), has aliases that expand past MAX_YAML_VALUES values or an alias inside the very
    collection it names, or nests past MAX_YAML_DEPTH levels (PyYAML's composer recurses per level)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    loader = _ConfigLoader(text)
    try:
        root = loader.get_single_node()  # the node graph: nothing constructed yet
        if root is None:
            return None
        values, _ = _checked_size(root, {})
        if values > MAX_YAML_VALUES:
            raise _Refused(f"its aliases (*name) expand to {values:.3g} values, over {MAX_YAML_VALUES}")
        return loader.construct_document(root)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    except _Refused as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except RecursionError:  # the limits above should leave none; a traceback would say less
        raise ConfigError(f"{path}: too deeply nested or recursive to read") from None
    finally:
        loader.dispose()


def yaml_value(text: str) -> Any:
    """An override's value, read as a config file's values are (base-60 numbers stay text)."""
    loader = _ConfigLoader(text)  # a SafeLoader: what yaml.safe_load does, with this loader
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class _Refused(Exception):
    """Valid YAML that a config file must not be."""


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads base-60 numbers as text and refuses, while composing, nesting past
    MAX_YAML_DEPTH and an alias inside the collection it names (`a: &a [*a]`, a cycle)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._open: list[str | None] = []  # the anchors of the collections being composed

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        if kind is yaml.ScalarNode and implicit[0] and _SEXAGESIMAL.match(value):
            return yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG
        return super().resolve(kind, value, implicit)

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) and event.anchor in self._open:
            raise _Refused(
                f"recursive alias *{event.anchor} at line {event.start_mark.line + 1}: it stands inside the "
                f"collection &{event.anchor} names, which would hold itself"
            )
        if not isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            return super().compose_node(parent, index)
        if len(self._open) >= MAX_YAML_DEPTH:
            raise _Refused(
                f"too deeply nested (more than {MAX_YAML_DEPTH} levels of lists and mappings, at line "
                f"{event.start_mark.line + 1})"
            )
        self._open.append(event.anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.pop()


def _checked_size(node: yaml.Node, memo: dict[int, tuple[int, int]], above: int = 0) -> tuple[int, int]:
    """(values, levels): how many values `node` holds once every alias is copied out (an alias is the
    same node, counted once per use but walked once) and how many levels of collections; raises on a
    mapping that gives a key twice, or past MAX_YAML_DEPTH levels with `above` levels over it."""
    if id(node) not in memo:
        if isinstance(node, yaml.CollectionNode) and above >= MAX_YAML_DEPTH:
            raise _Refused(_too_deep_aliases())
        size, children = 1, []
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
                children += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        counted = [_checked_size(child, memo, above + 1) for child in children]
        size += sum(values for values, _ in counted)
        levels = 1 + max((deep for _, deep in counted), default=0) if isinstance(node, yaml.CollectionNode) else 0
        memo[id(node)] = (size, levels)
    size, levels = memo[id(node)]
    if above + levels > MAX_YAML_DEPTH:
        raise _Refused(_too_deep_aliases())
    return size, levels


def _too_deep_aliases() -> str:
    return (
        f"too deeply nested (more than {MAX_YAML_DEPTH} levels of lists and mappings once its aliases are copied out)"
    )
