"""Load a user's function from a spec: `package.module:function` or `path/to/file.py:function`.

A file path is resolved against the current working directory. A file is loaded as a module
registered under a private name (`_slime_plugin_<stem>_<hash>`), once per process; so across
processes (Ray actors) pass the spec string and load it there, not the function object.

A file plugin imports modules beside it as a script would (`from task import grade` next to
`task.py`): its folder goes on `sys.path`, at the end, so it never shadows an installed module.
A module the file imports that exists both beside it and elsewhere is an error naming both paths,
instead of one of the two silently winning.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from slime.errors import UserError

SPEC_FORMS = "`package.module:function` or `path/to/file.py:function`"


class PluginError(UserError, ValueError):
    """A plugin spec that cannot be loaded; the message says which part is wrong and why."""

    hint = "a plugin is FILE.py:NAME or package.module:NAME, importable where the job runs (docs/rewards.md)"


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
    _add_folder_to_path(spec, path)
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


def _imported_names(path: Path) -> set[str]:
    """Top-level module names the file imports (absolute imports only); empty if it does not parse
    (running it reports the syntax error with its line)."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _provided_elsewhere(mod: str) -> str | None:
    """Where `mod` would be imported from without the plugin's folder, or None."""
    if mod in sys.builtin_module_names:
        return f"the built-in module {mod!r}"
    loaded = sys.modules.get(mod)
    if loaded is not None:
        return getattr(loaded, "__file__", None) or f"the already imported module {mod!r}"
    try:
        found = importlib.util.find_spec(mod)
    except (ImportError, ValueError):
        return None
    if found is None:
        return None
    return found.origin or ", ".join(found.submodule_search_locations or []) or mod


def _add_folder_to_path(spec: str, path: Path) -> None:
    """Make the plugin's folder importable, after everything already on sys.path; refuse a module
    name the file imports that both its folder and another place provide."""
    folder = path.parent
    if str(folder) in {str(Path(p or ".").resolve()) for p in sys.path}:
        return  # already importable the way a script's folder is
    for mod in sorted(_imported_names(path)):
        beside = next((c for c in (folder / f"{mod}.py", folder / mod) if c.exists()), None)
        elsewhere = _provided_elsewhere(mod) if beside is not None else None
        if elsewhere is not None:
            raise PluginError(
                f"plugin spec {spec!r}: {path.name} imports {mod!r}, which is both {beside} beside it and "
                f"{elsewhere}; rename the one beside the plugin"
            )
    sys.path.append(str(folder))


def _callables(module: ModuleType, limit: int = 8) -> str:
    public = {n: v for n, v in vars(module).items() if not n.startswith("_") and callable(v)}
    own = [n for n, v in public.items() if getattr(v, "__module__", None) == module.__name__]
    names = sorted(own or public)
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
