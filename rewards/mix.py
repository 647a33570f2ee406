"""Combining rewards: a weighted sum, and routing by a metadata field.

    WeightedSum([(exact_match, 0.7), ("my_rewards.py:judge", 0.3)])
    RouteByField("task", {"math": math_answer, "code": "code_rm.py:run_tests"}, default=f1)

Children may be callables or specs, in any style `rewards.adapters` accepts; each child returns a
number, a bool or a dict with "score" (and optionally "step_scores"/"step_ends" and "info"). Both
return a native-signature callable `fn(prompt, response, label, metadata)`. A RouteByField returns
its child's result unchanged. A WeightedSum returns the weighted sum of the scores, each child's
info under "mix.I/KEY" (I: the child's place in the list, from 0), and, when any child gives
per-step rewards, their weighted combination (`combined_steps`); a dict when there are either,
else a number. If any child is async the combination is async: a WeightedSum then runs all
children concurrently (sync ones on threads, off the event loop) and cancels the rest when one
fails. A child's failure (an exception, an exit, a value that is no reward) is re-raised as
`RewardChildError` naming the child, so the runner's failure reason says which part broke. A
RouteByField with no route for a sample's field value and no default raises `NoRouteError` naming
the value and the known routes.

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
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rewards.adapters import STYLES, DoesNotApply, adapt, detect_style, load_reward, native_caller
from rewards.exit_guard import call_as_reward, exit_code
from rewards.failure_text import describe_exception
from rewards.plugin import load_function
from rewards.runner import StepScores, _describe, _is_async, check_reward_value
from slime.errors import UserError
from slime.security import redact, redact_url


class RewardChildError(RuntimeError):
    """A child of a combined reward raised or returned something that is not a score."""


class NoRouteError(LookupError):
    """RouteByField found no route for a sample and has no default."""


@dataclass(frozen=True)
class Scored:
    """A part's result, checked: its score, per-step rewards and info, and the value it returned."""

    score: float
    steps: StepScores | None = None
    info: dict[str, Any] | None = None
    value: Any = None

    def as_value(self) -> float | dict[str, Any]:
        """As a reward returns it: the number, or a dict when there are steps or info."""
        if self.steps is None and not self.info:
            return self.score
        out: dict[str, Any] = {"score": self.score}
        if self.steps is not None:
            out["step_scores"], out["step_ends"] = list(self.steps.scores), list(self.steps.ends)
        if self.info:
            out["info"] = self.info
        return out


def checked(value: Any, name: str, response: str) -> Scored:
    """A part's return value checked as the runner checks a reward's (a finite number, or a dict with
    "score" and optionally step rewards and info), or RewardChildError naming the part and why not."""
    score, failure, extras = check_reward_value(value, f"reward {name}", response)
    if score is None:
        raise RewardChildError(failure)
    return Scored(score, extras.get("steps"), extras.get("info"), value)


def combined_steps(parts: Sequence[tuple[float, Scored]], response: str) -> StepScores | None:
    """The per-step rewards of sum(weight * part), None when no part gives any. Token rewards add up
    (PPO sums them with the outcome's), so each part's weighted step scores are kept at their
    step_ends, summed where ends meet; a part without steps counts at the response's last character,
    where its outcome would have been."""
    if all(part.steps is None for _, part in parts):
        return None
    at: dict[int, float] = {}
    for weight, part in parts:
        steps = part.steps or StepScores((part.score,), (max(len(response) - 1, 0),))
        for score, end in zip(steps.scores, steps.ends):
            at[end] = at.get(end, 0.0) + weight * score
    return StepScores(tuple(at[end] for end in sorted(at)), tuple(sorted(at)))


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
        if isinstance(exc, SystemExit):  # it must not end the thread, nor escape into the event loop
            return RewardChildError(f"child reward {self.name} exited ({exit_code(exc)})")
        return RewardChildError(f"child reward {self.name} raised {describe_exception(exc)}")

    def sync(self, prompt: str, response: str, label: Any, metadata: dict) -> Scored | None:
        """The child's checked result; None when it does not apply to this sample (DoesNotApply)."""
        try:
            value = self._call(prompt, response, label, metadata)
        except DoesNotApply:
            return None
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            raise self._fail(exc) from exc
        return checked(value, self.name, response)

    async def run(self, prompt: str, response: str, label: Any, metadata: dict) -> Scored | None:
        try:
            if self.is_async:
                value = await self._call(prompt, response, label, metadata)
            else:  # on asyncio's threads, marked so that an os._exit there fails this call (exit_guard)
                value = await asyncio.to_thread(call_as_reward, self._call, prompt, response, label, metadata)
        except DoesNotApply:
            return None
        # KeyboardInterrupt too: escaping a child's task, it would stop the event loop
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            raise self._fail(exc) from exc
        return checked(value, self.name, response)


def _finish(fn: Callable[..., Any], qualname: str, **attrs: Any) -> Callable[..., Any]:
    fn.__qualname__ = qualname
    fn.__module__ = ""  # the runner names failures after the qualname alone
    for key, value in attrs.items():
        setattr(fn, key, value)
    return fn


def WeightedSum(children: Sequence[tuple[Callable[..., Any] | str, float]]) -> Callable[..., Any]:
    """sum(weight * child(...)); async if any child is. The parts' info and per-step rewards are
    kept (see `_weighted`)."""
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

        async def reward(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> Any:
            meta = metadata if metadata is not None else {}
            tasks = [asyncio.ensure_future(c.run(prompt, response, label, meta)) for c, _ in parts]
            try:
                results = await asyncio.gather(*tasks)
            except BaseException:  # one failure (or our own cancellation) cancels the others
                for task in tasks:
                    task.cancel()
                raise
            return _weighted(parts, results, label_, response)
    else:

        def reward(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> Any:
            meta = metadata if metadata is not None else {}
            results = [c.sync(prompt, response, label, meta) for c, _ in parts]
            return _weighted(parts, results, label_, response)

    return _finish(reward, label_, children=[(c.fn, w) for c, w in parts])


def _weighted(
    parts: list[tuple[_Child, float]], results: list[Scored | None], name: str, response: str
) -> float | dict[str, Any]:
    """The weighted sum of the children that scored (TRL's nansum; none scoring fails the sample),
    their weighted per-step rewards (combined_steps), and the info of child i under "mix.i/KEY"."""
    scored = [(i, w, result) for i, ((_, w), result) in enumerate(zip(parts, results)) if result is not None]
    if not scored:
        raise DoesNotApply(f"{name}: none of its rewards applies to this sample (each returned None)")
    info = {f"mix.{i}/{key}": value for i, _, result in scored for key, value in (result.info or {}).items()}
    steps = combined_steps([(w, result) for _, w, result in scored], response)
    return Scored(sum(w * result.score for _, w, result in scored), steps, info).as_value()


def _applied(result: Scored | None, child: _Child) -> Any:
    """What the route's child returned, unchanged (its step rewards and info included)."""
    if result is None:
        raise DoesNotApply(f"child reward {child.name} does not apply to this sample (it returned None)")
    return result.value


def RouteByField(
    field: str = "task",
    routes: Mapping[str, Callable[..., Any] | str] | None = None,
    default: Callable[..., Any] | str | None = None,
) -> Callable[..., Any]:
    """Score each sample with routes[metadata[field]] (or `default`), whose result it returns
    unchanged; async if any route is."""
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

        async def reward(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> Any:
            meta = metadata if metadata is not None else {}
            child = pick(meta)
            return _applied(await child.run(prompt, response, label, meta), child)
    else:

        def reward(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> Any:
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
    "Scored",
    "WeightedSum",
    "checked",
    "combined_steps",
    "describe_spec",
    "load_reward_spec",
]
