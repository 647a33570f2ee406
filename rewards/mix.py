"""Combining rewards: a weighted sum, and routing by a metadata field.

    WeightedSum([(exact_match, 0.7), ("my_rewards.py:judge", 0.3)])
    RouteByField("task", {"math": math_answer, "code": "code_rm.py:run_tests"}, default=f1)

Children may be callables or specs, in any style `rewards.adapters` accepts; each child returns a
number, a bool or a dict with "score". Both return a native-signature callable
`fn(prompt, response, label, metadata)`. If any child is async the combination is async: a
WeightedSum then runs all children concurrently (sync ones on threads, off the event loop) and
cancels the rest when one fails. A child's failure is re-raised as `RewardChildError` naming the
child, so the runner's failure reason says which part broke. A RouteByField with no route for a
sample's field value and no default raises `NoRouteError` naming the value and the known routes.

From config, `load_reward_spec(spec)` takes a spec string, or a dict (recursive):

    {"fn": "pkg.mod:f", "style": "trl"}                  # one function; style optional
    {"fn": "rewards.prm:prm_reward", "kwargs": {...}}    # a factory, called once with kwargs
    {"mix": [{"fn": SPEC, "weight": 0.7}, ...]}          # WeightedSum; SPEC is a string or a dict
    {"route": "task", "routes": {"math": SPEC, ...}, "default": SPEC}   # default optional
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rewards.adapters import STYLES, DoesNotApply, adapt, detect_style, load_reward, native_caller
from rewards.plugin import load_function
from rewards.runner import _describe, _is_async
from slime.errors import UserError
from slime.security import redact, redact_url


class RewardChildError(RuntimeError):
    """A child of a combined reward raised or returned something that is not a score."""


class NoRouteError(LookupError):
    """RouteByField found no route for a sample and has no default."""


def as_score(value: Any, name: str) -> float:
    """A child's return value as a finite float, or RewardChildError saying why not."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise RewardChildError(
                f"reward {name} returned a dict without a 'score' key (keys: {sorted(map(str, value))[:10]})"
            )
        value = value["score"]
    if value is None or isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise RewardChildError(f"reward {name} returned {type(value).__name__} {value!r:.80}, not a number")
    score = float(value)
    if not math.isfinite(score):
        raise RewardChildError(f"reward {name} returned {score}, not a finite number")
    return score


class _Child:
    def __init__(self, fn: Callable[..., Any] | str) -> None:
        if isinstance(fn, str):
            self.name, self.fn = fn, load_reward(fn)
        elif callable(fn):
            self.fn = adapt(fn)
            self.name = _describe(self.fn)
        else:
            raise TypeError(f"a reward must be a callable or a spec string, got {type(fn).__name__} {fn!r:.80}")
        self.is_async = _is_async(self.fn)
        self._call = native_caller(self.fn, self.name)

    def _fail(self, exc: BaseException) -> RewardChildError:
        if isinstance(exc, (RewardChildError, NoRouteError)):
            return exc  # type: ignore[return-value]  # already names the failing part
        return RewardChildError(f"child reward {self.name} raised {type(exc).__name__}: {exc}")

    def sync(self, prompt: str, response: str, label: Any, metadata: dict) -> float | None:
        """The child's score; None when it does not apply to this sample (DoesNotApply)."""
        try:
            value = self._call(prompt, response, label, metadata)
        except DoesNotApply:
            return None
        except Exception as exc:
            raise self._fail(exc) from exc
        return as_score(value, self.name)

    async def run(self, prompt: str, response: str, label: Any, metadata: dict) -> float | None:
        try:
            if self.is_async:
                value = await self._call(prompt, response, label, metadata)
            else:
                value = await asyncio.to_thread(self._call, prompt, response, label, metadata)
        except DoesNotApply:
            return None
        except Exception as exc:
            raise self._fail(exc) from exc
        return as_score(value, self.name)


def _finish(fn: Callable[..., Any], qualname: str, **attrs: Any) -> Callable[..., Any]:
    fn.__qualname__ = qualname
    fn.__module__ = ""  # the runner names failures after the qualname alone
    for key, value in attrs.items():
        setattr(fn, key, value)
    return fn


def WeightedSum(children: Sequence[tuple[Callable[..., Any] | str, float]]) -> Callable[..., Any]:
    """sum(weight * child(...)); async if any child is."""
    if not children:
        raise ValueError("WeightedSum needs at least one (fn, weight) pair")
    parts: list[tuple[_Child, float]] = []
    for i, item in enumerate(children):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"WeightedSum item {i} must be a (fn, weight) pair, got {item!r:.80}")
        fn, weight = item
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"WeightedSum item {i}: weight must be a finite number, got {weight!r}")
        parts.append((_Child(fn), float(weight)))
    label_ = "WeightedSum(" + " + ".join(f"{w:g}*{c.name}" for c, w in parts) + ")"

    if any(c.is_async for c, _ in parts):

        async def reward(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> float:
            meta = metadata if metadata is not None else {}
            tasks = [asyncio.ensure_future(c.run(prompt, response, label, meta)) for c, _ in parts]
            try:
                scores = await asyncio.gather(*tasks)
            except BaseException:  # one failure (or our own cancellation) cancels the others
                for task in tasks:
                    task.cancel()
                raise
            return _weighted(parts, scores, label_)
    else:

        def reward(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> float:
            meta = metadata if metadata is not None else {}
            return _weighted(parts, [c.sync(prompt, response, label, meta) for c, _ in parts], label_)

    return _finish(reward, label_, children=[(c.fn, w) for c, w in parts])


def _weighted(parts: list[tuple[_Child, float]], scores: list[float | None], name: str) -> float:
    """The weighted sum of the children that scored (TRL's nansum); none scoring fails the sample."""
    scored = [(w, score) for (_, w), score in zip(parts, scores) if score is not None]
    if not scored:
        raise DoesNotApply(f"{name}: none of its rewards applies to this sample (each returned None)")
    return sum(w * score for w, score in scored)


def _applied(score: float | None, child: _Child) -> float:
    if score is None:
        raise DoesNotApply(f"child reward {child.name} does not apply to this sample (it returned None)")
    return score


def RouteByField(
    field: str = "task",
    routes: Mapping[str, Callable[..., Any] | str] | None = None,
    default: Callable[..., Any] | str | None = None,
) -> Callable[..., Any]:
    """Score each sample with routes[metadata[field]] (or `default`); async if any route is."""
    if not routes and default is None:
        raise ValueError("RouteByField needs routes or a default")
    table = {str(key): _Child(fn) for key, fn in (routes or {}).items()}
    fallback = _Child(default) if default is not None else None
    known = sorted(table)

    def pick(metadata: dict) -> _Child:
        value = metadata.get(field)
        child = table.get(str(value)) if value is not None else None
        if child is None:
            child = fallback
        if child is None:
            got = f"no {field!r} field" if field not in metadata else f"{field}={value!r}"
            raise NoRouteError(f"RouteByField: no reward for {got}; known routes: {known} and no default")
        return child

    everyone = list(table.values()) + ([fallback] if fallback else [])
    if any(c.is_async for c in everyone):

        async def reward(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> float:
            meta = metadata if metadata is not None else {}
            child = pick(meta)
            return _applied(await child.run(prompt, response, label, meta), child)
    else:

        def reward(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> float:
            meta = metadata if metadata is not None else {}
            child = pick(meta)
            return _applied(child.sync(prompt, response, label, meta), child)

    return _finish(
        reward,
        f"RouteByField({field!r}: {', '.join(known)}{'; default' if fallback else ''})",
        routes={k: c.fn for k, c in table.items()},
        default=fallback.fn if fallback else None,
    )


# --- from config ---------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FnSpec(_Strict):
    fn: str = Field(min_length=1)
    style: Literal["native", "slime", "verl", "trl", "openrlhf"] | None = None
    # When given, `fn` is a factory called once with these keywords; it returns the reward
    # (e.g. rewards.prm:prm_reward with model_dir, rewards.judge:llm_judge with a URL).
    kwargs: dict[str, Any] | None = None


class MixItem(_Strict):
    fn: Any  # a spec string or a nested dict, parsed recursively
    weight: float = Field(allow_inf_nan=False)


class MixSpec(_Strict):
    mix: list[MixItem] = Field(min_length=1)


class RouteSpec(_Strict):
    route: str = Field(min_length=1)
    routes: dict[str, Any]
    default: Any = None

    @field_validator("routes")
    @classmethod
    def _some(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            raise ValueError("routes must name at least one field value")
        return v


_FORMS = (
    "a spec string 'pkg.module:fn' or 'path.py:fn'; {'fn': ..., 'style': ...}; "
    "{'mix': [{'fn': ..., 'weight': ...}, ...]}; {'route': field, 'routes': {...}, 'default': ...}"
)


class RewardSpecError(UserError, ValueError):
    """A reward spec from config that is malformed; the message gives its path and what is wrong."""

    hint = "docs/rewards.md shows each kind of reward spec and how to mix them"


def load_reward_spec(spec: str | dict, _path: str = "reward") -> Callable[..., Any]:
    """A native-signature reward from a spec string or a (recursive) mix/route dict."""
    if isinstance(spec, str):
        return load_reward(spec)
    if not isinstance(spec, Mapping):
        raise RewardSpecError(f"{_path}: expected {_FORMS}; got {type(spec).__name__} {spec!r:.80}")
    keys = set(spec)
    if "mix" in keys:
        model = _validate(MixSpec, spec, _path)
        return WeightedSum(
            [(load_reward_spec(item.fn, f"{_path}.mix.{i}.fn"), item.weight) for i, item in enumerate(model.mix)]
        )
    if "route" in keys or "routes" in keys:
        model = _validate(RouteSpec, spec, _path)
        routes = {k: load_reward_spec(v, f"{_path}.routes.{k}") for k, v in model.routes.items()}
        default = load_reward_spec(model.default, f"{_path}.default") if model.default is not None else None
        return RouteByField(model.route, routes, default)
    if "fn" in keys:
        model = _validate(FnSpec, spec, _path)
        if model.kwargs is None:
            return load_reward(model.fn, style=model.style)
        factory = load_function(model.fn)
        shown = redact(model.kwargs)  # kwargs may hold a judge's api_key: never in a message
        try:
            reward = factory(**model.kwargs)
        except Exception as exc:
            raise RewardSpecError(f"{_path}: {model.fn}(**{shown}) failed: {type(exc).__name__}: {exc}") from exc
        return adapt(reward, style=model.style, name=f"{model.fn}({', '.join(f'{k}={v!r}' for k, v in shown.items())})")
    raise RewardSpecError(f"{_path}: unrecognised keys {sorted(map(str, keys))}; expected {_FORMS}")


def reads_model_text(spec: Any) -> bool:
    """Whether the reward `spec` names has an OpenRLHF-style part: the only kind that reads
    metadata["model_prompt"] and ["model_response"], which cost a decode more per response, so
    the callers make them only for it. Read off the spec, without calling any factory (OpenRLHF's
    reward_func is a plain function, or a factory given `style: openrlhf`)."""
    if isinstance(spec, str):
        try:
            return detect_style(load_function(spec)) == "openrlhf"
        except Exception:  # loading the reward itself reports what is wrong with it
            return False
    if not isinstance(spec, Mapping):
        return False
    if "mix" in spec:
        return any(isinstance(item, Mapping) and reads_model_text(item.get("fn")) for item in spec["mix"] or [])
    if "route" in spec or "routes" in spec:
        return any(reads_model_text(part) for part in [*(spec.get("routes") or {}).values(), spec.get("default")])
    if spec.get("style") is not None or spec.get("kwargs") is not None:
        return spec.get("style") == "openrlhf"
    return reads_model_text(spec.get("fn"))


def describe_spec(spec: Any) -> str:
    """A reward spec as shown in names, /health, failure messages, logs and Redis: secrets in its
    kwargs (``api_key``, ``token``, passwords in URLs, ...) replaced by ``***``."""
    if isinstance(spec, str):
        return redact_url(spec)
    return str(redact(spec))


def _validate(model: type[BaseModel], spec: Mapping, path: str) -> Any:
    try:
        return model.model_validate(dict(spec))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join([path, *map(str, e['loc'])])}: {e['msg']}" for e in exc.errors())
        raise RewardSpecError(f"invalid reward spec: {problems}") from None


__all__ = [
    "STYLES",
    "NoRouteError",
    "RewardChildError",
    "RewardSpecError",
    "RouteByField",
    "WeightedSum",
    "as_score",
    "describe_spec",
    "load_reward_spec",
]
