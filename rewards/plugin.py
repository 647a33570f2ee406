"""Load a user's function from a spec: `package.module:function` or `path/to/file.py:function`.

A file path is resolved against the current working directory. A file is loaded as a module
registered under a private name (`_slime_plugin_<stem>_<hash>`), once per process; so across
processes (Ray actors) pass the spec string and load it there, not the function object.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

SPEC_FORMS = "`package.module:function` or `path/to/file.py:function`"


class PluginError(ValueError):
    """A plugin spec that cannot be loaded; the message says which part is wrong and why."""


def load_function(spec: str) -> Callable[..., Any]:
    """Import the module or file named by `spec` and return its callable attribute."""
    if not isinstance(spec, str) or ":" not in spec:
        raise PluginError(f"plugin spec {spec!r} has no ':'; write {SPEC_FORMS}")
    target, _, attr = spec.strip().rpartition(":")
    if not target or not attr:
        raise PluginError(
            f"plugin spec {spec!r}: empty {'module/file' if not target else 'function'} name; write {SPEC_FORMS}"
        )

    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _load_file(spec, target)
    else:
        module = _import_module(spec, target)

    obj: Any = module
    for part in attr.split("."):  # `module:Class.method` is allowed
        if not hasattr(obj, part):
            raise PluginError(
                f"plugin spec {spec!r}: {target} has no attribute {attr!r}; "
                f"callables it defines: {_callables(module) or '(none)'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"plugin spec {spec!r}: {attr} is a {type(obj).__name__}, not callable")
    return obj


def _import_module(spec: str, name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        # Distinguish "the module does not exist" from "it exists but imports something missing".
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise PluginError(
                f"plugin spec {spec!r}: module {name!r} not found (is it installed or on PYTHONPATH? "
                f"working directory: {Path.cwd()})"
            ) from exc
        raise PluginError(
            f"plugin spec {spec!r}: importing module {name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    except Exception as exc:
        raise PluginError(
            f"plugin spec {spec!r}: importing module {name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _load_file(spec: str, target: str) -> ModuleType:
    path = Path(target).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    path = path.resolve()
    if path.suffix != ".py":
        raise PluginError(f"plugin spec {spec!r}: a file plugin must be a .py file, got {path}")
    if not path.is_file():
        raise PluginError(f"plugin spec {spec!r}: file not found: {path} (relative paths start at {Path.cwd()})")

    name = f"_slime_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise PluginError(f"plugin spec {spec!r}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before running it: dataclasses and pickling look the module up by name.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a top-level sys.exit() is a broken plugin, not a request to quit
        del sys.modules[name]
        raise PluginError(f"plugin spec {spec!r}: running {path} failed: {type(exc).__name__}: {exc}") from exc
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _callables(module: ModuleType, limit: int = 8) -> str:
    public = {n: v for n, v in vars(module).items() if not n.startswith("_") and callable(v)}
    own = [n for n, v in public.items() if getattr(v, "__module__", None) == module.__name__]
    names = sorted(own or public)
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
