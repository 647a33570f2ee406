"""Other frameworks' reward functions, called unchanged through the native signature.

`load_reward(spec)` loads a function with `rewards.plugin.load_function` and returns a callable
with the native signature `fn(prompt, response, label, metadata)` (see rewards/runner.py). An
`async def` stays async and a plain `def` stays sync, so the runner keeps sync code off its loop.

The style is detected from the parameter NAMES (all four frameworks call by keyword, except
slime, which calls `rm(args, sample)` positionally):

    native  has parameters `prompt` and `response`             -> returned unchanged
    slime   first two parameters are `args, sample`            -> rm(args, sample)
    verl    has parameters `solution_str` and `ground_truth`   -> compute_score(data_source=...,
                                                                  solution_str=..., ground_truth=...,
                                                                  extra_info=...)
    TRL     has a parameter `completions`                      -> f(prompts=[p], completions=[r], ...)
    OpenRLHF has parameters `queries`, `prompts` and `labels`  -> reward_func(queries=[p + r],
                                                                  prompts=[p], labels=[label])

A function matching none of these, or more than one, is refused with a message naming it and the
accepted signatures; pass `style=` ("native", "slime", "verl", "trl", "openrlhf") to decide explicitly (e.g. a
`def f(*args, **kwargs)` wrapper).

What each style receives (metadata = the sample's dataset columns and other per-sample data):

* slime: `args` is a `types.SimpleNamespace` with `label`, `metadata`, `rm_type`
  (metadata["rm_type"] or None) and every metadata key that is a valid identifier and does not
  clash with those; `sample` is a `RewardSample` with `.prompt`, `.response`, `.label`,
  `.metadata` (plus `.reward=None`, `.status=Sample.Status.COMPLETED`; `from slime.utils.types
  import Sample` works as in slime). It may return a number or a dict
  with "score".
* verl: `data_source` = metadata["data_source"], else metadata["task"], else None;
  `ground_truth` = label, else (no label) metadata["reward_model"]["ground_truth"] as in verl's
  parquet rows; `extra_info` = metadata["extra_info"] when the row has that dict column (as verl
  passes it), else metadata. Keywords the function does not take are not
  passed (verl's own `compute_score(solution_str, ground_truth)` helpers work). A dict result
  gives its "score".
* TRL: keywords `prompts=[prompt]`, `completions=[response]`, every metadata column as a
  one-element list (as TRL passes dataset columns), and `ground_truth=[label]`, `label=[label]`
  unless metadata has columns of those names. Without `**kwargs` only the keywords it names are
  passed; a required one that is absent is a clear error. A chat-messages prompt (metadata
  "prompt_messages") is passed as TRL's conversational format: `prompts=[messages]`,
  `completions=[[{"role": "assistant", "content": response}]]`; a text prompt as plain strings
  (TRL's "standard" format). `completion_ids=[ids]` when the caller gives the response's token
  ids (EOS included) as metadata["response_ids"]; `log_metric(name, value)` and
  `log_extra(column, values)` put what they log in the sample's `reward_info`; `trainer_state` is
  not supplied. A function taking `completion_ids` but no `completions` (TRL's
  `get_soft_overlong_punishment`, `get_repetition_penalty_reward`) is TRL-style too. The result
  must be a list (or tuple) of exactly one score.
* OpenRLHF (`reward_func(queries, prompts, labels, **kwargs)`, the file `--remote_rm_url` names):
  `queries=[text]`, where text is what the model read (the prompt after its chat template, when
  the caller passes it as metadata["model_prompt"]) followed by the response, else prompt +
  response; `prompts=[that prompt]` (so `query[len(prompt):]` is the response, as in OpenRLHF),
  `labels=[label]`. The result is OpenRLHF's dict: "rewards" (a list
  or tensor, one per query) and optionally "scores" (OpenRLHF's filter score, not used) and
  "extra_logs" (kept in the sample's metadata as `reward_info`); a bare list or tensor is taken as
  the rewards.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any, NamedTuple

from rewards.failure_text import exception_text, shown, type_name
from rewards.plugin import load_function
from rewards.runner import _describe, _is_async, _keyword_plan
from slime.errors import UserError
from slime.utils.types import Sample

STYLES = ("native", "slime", "verl", "trl", "openrlhf")

ACCEPTED_SIGNATURES = (
    "native `fn(prompt, response, label, metadata)` (label/metadata optional, sync or async); "
    "slime `async def rm(args, sample)`; "
    "verl `compute_score(data_source, solution_str, ground_truth, extra_info=None)`; "
    "TRL `f(completions, **kwargs)` (optionally `prompts=`) returning a list of floats; "
    "OpenRLHF `reward_func(queries, prompts, labels)` returning {'rewards': [...]}"
)


class DoesNotApply(ValueError):
    """A reward that says it does not score this sample (a TRL reward's None): a WeightedSum leaves
    it out of its sum, as TRL's nansum does; alone, the sample fails with the reason."""


class RewardSignatureError(UserError, TypeError):
    """A reward function whose signature matches no supported style, or more than one."""

    hint = "docs/rewards.md, 'Plugging in a function', lists the signatures a reward function may have"


RewardSample = Sample  # what a slime-style `rm(args, sample)` receives (slime.utils.types)


def load_reward(spec: str, style: str | None = None) -> Callable[..., Any]:
    """Load `spec` (`package.module:function` or `path/to/file.py:function`) as a native reward."""
    return adapt(load_function(spec), style=style, name=spec)


def adapt(fn: Callable[..., Any], style: str | None = None, name: str | None = None) -> Callable[..., Any]:
    """Wrap an already-loaded function of any supported style as a native reward."""
    name = name or _describe(fn)
    if style is None:
        style = detect_style(fn, name)
    elif style not in STYLES:
        raise ValueError(f"reward function {name}: unknown style {style!r}; choose one of {', '.join(STYLES)}")
    if style == "native":
        _keyword_plan(fn, name)  # raises a clear TypeError now rather than on every call
        return fn
    return {"slime": _slime, "verl": _verl, "trl": _trl, "openrlhf": _openrlhf}[style](fn, name)


def detect_style(fn: Callable[..., Any], name: str | None = None) -> str:
    """The style `fn`'s parameter names say it is written in; see the module docstring."""
    name = name or _describe(fn)
    sig, names, positional = parameter_names(fn, f"reward function {name}", ACCEPTED_SIGNATURES)
    matches = matching_styles(names, positional, group=False)
    if len(matches) == 1:
        return matches[0]
    why = f"matches several styles ({', '.join(matches)})" if matches else "matches no supported style"
    raise RewardSignatureError(
        f"reward function {name}{sig} {why}; choose its style in the config, reward.fn={{fn: {name}, style: S}} "
        f"(in Python: style=S), S one of {', '.join(STYLES)}. "
        f"Accepted signatures: {ACCEPTED_SIGNATURES}"
    )


def parameter_names(fn: Callable[..., Any], who: str, accepted: str) -> tuple[inspect.Signature, list[str], list[str]]:
    """`fn`'s signature, its parameter names, and those it takes by position (the style rules read them)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise RewardSignatureError(
            f"{who}: its signature cannot be inspected ({exc}); choose its style: reward.fn={{fn: ..., style: S}} (in Python: style=S). Accepted signatures: {accepted}"
        ) from None
    positional = [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return sig, list(sig.parameters), positional


def matching_styles(names: list[str], positional: list[str], group: bool) -> list[str]:
    """The styles whose parameter names these are: of a per-sample reward, or (`group`) of a group
    reward, where slime's, verl's and the native names are plural."""
    response, sample, solution, truth = (
        ("responses", "samples", "solution_strs", "ground_truths")
        if group
        else ("response", "sample", "solution_str", "ground_truth")
    )
    rules = {
        "native": "prompt" in names and response in names,
        "slime": positional[:2] == ["args", sample],
        "verl": solution in names and truth in names,
        "trl": "completions" in names or "completion_ids" in names,
        "openrlhf": {"queries", "prompts", "labels"} <= set(names),
    }
    return [style for style, matched in rules.items() if matched]


def native_caller(fn: Callable[..., Any], name: str | None = None) -> Callable[[str, str, Any, dict], Any]:
    """`call(prompt, response, label, metadata)` passing only the keywords `fn` takes (as the runner does)."""
    pass_label, pass_metadata = _keyword_plan(fn, name or _describe(fn))

    def call(prompt: str, response: str, label: Any, metadata: dict[str, Any] | None) -> Any:
        kwargs: dict[str, Any] = {"prompt": prompt, "response": response}
        if pass_label:
            kwargs["label"] = label
        if pass_metadata:
            kwargs["metadata"] = metadata if metadata is not None else {}
        return fn(**kwargs)

    return call


# --- styles --------------------------------------------------------------------------------------


def _native(
    fn: Callable[..., Any],
    name: str,
    build: Callable[..., tuple[tuple, dict]],
    post: Callable[[Any, dict], Any],
    explain: Callable[[Exception, dict], str | None] = lambda exc, kwargs: None,
) -> Callable[..., Any]:
    """A native-signature function calling `fn(*args, **kwargs)` from `build`, sync or async like fn;
    `post(value, kwargs)` turns what it returned into a native reward. `explain(exc, kwargs)`: a
    likely cause to add to an exception fn raised."""

    def raised(exc: Exception, kwargs: dict) -> Exception:
        why = explain(exc, kwargs)
        if not why:
            return exc
        try:
            return type(exc)(f"{exception_text(exc)} ({why})")
        except Exception:  # an exception class that takes other arguments
            return exc

    if _is_async(fn):

        async def reward(prompt: str, response: str, label: Any = None, metadata: dict[str, Any] | None = None) -> Any:
            args, kwargs = build(prompt, response, label, dict(metadata or {}))
            try:
                value = await fn(*args, **kwargs)
            except Exception as exc:
                raise raised(exc, kwargs) from exc
            return post(value, kwargs)
    else:

        def reward(prompt: str, response: str, label: Any = None, metadata: dict[str, Any] | None = None) -> Any:
            args, kwargs = build(prompt, response, label, dict(metadata or {}))
            try:
                value = fn(*args, **kwargs)
            except Exception as exc:
                raise raised(exc, kwargs) from exc
            return post(value, kwargs)

    reward.__name__ = getattr(fn, "__name__", "reward")
    reward.__qualname__ = name  # the runner names failures after this
    reward.__module__ = ""
    reward.__wrapped_reward__ = fn  # type: ignore[attr-defined]
    return reward


def slime_args(label: Any, metadata: dict[str, Any]) -> SimpleNamespace:
    """slime's `args` for a sample (or a group): its metadata keys, label, metadata, rm_type, and
    rollout_max_response_len (the response's budget, metadata's max_new_tokens)."""
    fields = {k: v for k, v in metadata.items() if isinstance(k, str) and k.isidentifier()}
    fields.update(label=label, metadata=metadata, rm_type=metadata.get("rm_type"))
    fields["rollout_max_response_len"] = metadata.get("max_new_tokens")
    return SimpleNamespace(**fields)


def slime_sample(prompt: Any, response: str, label: Any, metadata: dict[str, Any]) -> Sample:
    """What a slime-style reward gets as `sample`: TRUNCATED when the response ran out of tokens
    (metadata's `finish_reason` "length", as the rollout gives it), COMPLETED otherwise."""
    truncated = metadata.get("finish_reason") == "length"
    status = Sample.Status.TRUNCATED if truncated else Sample.Status.COMPLETED
    length = len(metadata.get("response_ids") or ())
    return RewardSample(
        prompt=prompt, response=response, label=label, metadata=metadata, status=status, response_length=length
    )


def _slime(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def build(prompt, response, label, metadata):
        return (slime_args(label, metadata), slime_sample(prompt, response, label, metadata)), {}

    return _native(fn, name, build, lambda value, _: value)


def verl_fields(response: str, label: Any, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """verl's arguments for one response: data_source, solution_str, ground_truth, extra_info."""
    # verl's own rows: the answer in the `reward_model` column, `extra_info` a column of its own.
    column = metadata.get("reward_model")
    if label is None and isinstance(column, Mapping):
        label = column.get("ground_truth")
    return {
        "data_source": metadata.get("data_source", metadata.get("task")),
        "solution_str": response,
        "ground_truth": label,
        "extra_info": metadata["extra_info"] if isinstance(metadata.get("extra_info"), Mapping) else metadata,
    }


def _verl(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    accepts = _acceptor(fn)

    def build(prompt, response, label, metadata):
        return (), {k: v for k, v in verl_fields(response, label, metadata).items() if accepts(k)}

    def post(value: Any, _: dict) -> Any:
        if isinstance(value, Mapping) and "score" not in value:
            raise ValueError(
                f"verl-style reward {name} returned a dict without a 'score' key (keys: {sorted(map(str, value))[:10]})"
            )
        return verl_value(value)

    return _native(fn, name, build, post)


def verl_value(value: Any) -> Any:
    """A verl reward's result as a native one: verl logs a dict's keys other than "score" ("acc",
    "pred", ...); here they become its "info" (the sample's reward_info). Other values unchanged."""
    if not isinstance(value, Mapping) or "score" not in value:
        return value
    extras = {str(k): v for k, v in value.items() if k != "score"}
    return {"score": value["score"], "info": extras} if extras else value["score"]


# The response again, as token ids and as text with its special tokens (slime.data.scored_metadata):
# per response, so not in what a group's responses share, not sent to a reward server, not in the
# cache key (the response's text stands for them).
RESPONSE_KEYS = ("response_ids", "model_response")

_TRL_RESERVED = ("prompts", "completions", "completion_ids", "log_metric", "log_extra")

Item = tuple[str, str, Any, dict[str, Any]]  # what a reward scores: prompt, response, label, metadata


class _TrlLog:
    """TRL's `log_metric(name, value)` (one value for the batch) and `log_extra(column, values)` (one
    per completion): what they log goes to each completion's `reward_info`."""

    def __init__(self, count: int) -> None:
        self.values: list[dict[str, Any]] = [{} for _ in range(count)]

    def metric(self, name: str, value: Any) -> None:
        for info in self.values:
            info[str(name)] = _plain(value)

    def extra(self, column: str, values: Any) -> None:
        items = _as_list(values)
        for i, info in enumerate(self.values):
            info[str(column)] = items[i] if items is not None and len(items) == len(self.values) else _plain(values)


class BatchCall(NamedTuple):
    """A framework's batched reward call: `build(items) -> (args, kwargs)` for `fn`, and
    `post(value, kwargs, count) -> one result per item` (a number, a dict with "score", or None)."""

    build: Callable[[list[Item]], tuple[tuple, dict]]
    post: Callable[[Any, dict, int], list[Any]]


def trl_batch(fn: Callable[..., Any], name: str) -> BatchCall:
    """TRL's call: the batch's prompts and completions, each dataset column as a list (one value per
    completion), completion_ids, log_metric and log_extra."""
    accepts = _acceptor(fn)
    sig = inspect.signature(fn)
    required = [
        n
        for n, p in sig.parameters.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]

    def build(items: list[Item]) -> tuple[tuple, dict]:
        metas = [m for _, _, _, m in items]
        if all(isinstance(m.get("prompt_messages"), list) for m in metas):  # conversational: messages both ways
            offered: dict[str, Any] = {
                "prompts": [m["prompt_messages"] for m in metas],
                "completions": [[{"role": "assistant", "content": r}] for _, r, _, _ in items],
            }
        else:
            offered = {"prompts": [p for p, _, _, _ in items], "completions": [r for _, r, _, _ in items]}
        for key in dict.fromkeys(k for m in metas for k in m):
            if isinstance(key, str) and key not in _TRL_RESERVED and key != "prompt_messages":
                offered[key] = [m.get(key) for m in metas]
        offered.setdefault("ground_truth", [label for _, _, label, _ in items])
        offered.setdefault("label", [label for _, _, label, _ in items])
        if all(isinstance(m.get("response_ids"), list) for m in metas):  # completion_ids: the tokens, EOS included
            offered["completion_ids"] = [m["response_ids"] for m in metas]
        log = _TrlLog(len(items))
        offered["log_metric"], offered["log_extra"] = log.metric, log.extra
        missing = [n for n in required if n not in offered]
        if missing:
            ids = (
                "; completion_ids are the response's token ids, given to rewards run in_process or as a "
                "ray_actor (an HTTP reward server does not get them)"
                if "completion_ids" in missing
                else ""
            )
            raise TypeError(
                f"TRL-style reward {name} requires {missing}, which this sample does not have "
                f"(dataset columns in metadata: {sorted(k for k in offered if k not in _TRL_RESERVED)}){ids}"
            )
        return (), {k: v for k, v in offered.items() if accepts(k)}

    def post(value: Any, kwargs: dict, count: int) -> list[Any]:
        values = _as_list(value)
        if values is None:
            raise TypeError(
                f"TRL-style reward {name} returned {type_name(value)} {shown(value)}; "
                f"expected a list with one score per completion"
            )
        if len(values) != count:
            completions = "1 completion" if count == 1 else f"{count} completions"
            raise ValueError(
                f"TRL-style reward {name} returned {len(values)} scores for {completions}; "
                f"expected a list of exactly {count}"
            )
        log = getattr(kwargs.get("log_metric") or kwargs.get("log_extra"), "__self__", None)
        infos = log.values if isinstance(log, _TrlLog) else [{} for _ in values]
        return [{"score": v, "info": info} if info and v is not None else v for v, info in zip(values, infos)]

    return BatchCall(build, post)


def _trl(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    call = trl_batch(fn, name)

    def post(value: Any, kwargs: dict) -> Any:
        (result,) = call.post(value, kwargs, 1)
        if result is None:
            raise DoesNotApply(
                f"TRL-style reward {name} returned [None]: it does not apply to this sample (as in TRL, a mix "
                f"leaves it out of its sum; alone, it fails the sample)"
            )
        return result

    def explain(exc: Exception, kwargs: dict) -> str | None:
        completions = kwargs.get("completions") or [None]
        if isinstance(exc, (TypeError, KeyError, IndexError)) and isinstance(completions[0], str):
            return (
                "it got TRL's standard format, text completions, as TRL gives a dataset of text prompts; "
                "a reward written for conversational completions needs chat-message prompts in the dataset"
            )
        return None

    return _native(fn, name, lambda *item: call.build([item]), post, explain)


def openrlhf_prompt(prompt: str, metadata: Mapping[str, Any]) -> str:
    """OpenRLHF's `prompt`: the text the model read (metadata["model_prompt"], after its chat
    template); without it, the prompt."""
    read = metadata.get("model_prompt")
    return read if isinstance(read, str) else prompt


def openrlhf_query(prompt: str, response: str, metadata: Mapping[str, Any]) -> str:
    """OpenRLHF's `query`: the prompt as above, then the response as the model wrote it
    (metadata["model_response"]: special tokens and the stop token kept, as OpenRLHF decodes it;
    a reward model reads its score at that last token). `query[len(prompt):]` is the response."""
    wrote = metadata.get("model_response")
    return openrlhf_prompt(prompt, metadata) + (wrote if isinstance(wrote, str) else response)


def openrlhf_results(reply: Any, count: int, who: str) -> list[dict[str, Any]]:
    """OpenRLHF's reward reply for `count` queries ({"rewards": [...], "scores"?, "extra_logs"?}, or a
    bare list/tensor of rewards) as one {"score", "info"?} per query, in order. Per-query values of
    "extra_logs" (a list or tensor as long as the rewards) go to each query's info, a scalar to all."""
    if isinstance(reply, Mapping):
        if "rewards" not in reply:
            keys = sorted(str(k) for k in reply)[:10]
            raise ValueError(
                f"{who} answered without 'rewards' (keys: {keys}); OpenRLHF's reply is {{'rewards': [...]}}"
            )
        rewards, logs = reply["rewards"], reply.get("extra_logs")
    else:
        rewards, logs = reply, None
    values = _as_list(rewards)
    if values is None and count == 1 and (getattr(rewards, "ndim", None) == 0 or isinstance(rewards, (int, float))):
        values = [_plain(rewards)]  # one query, one number: OpenRLHF takes it too
    if values is None:
        raise TypeError(
            f"{who} gave rewards as {type_name(rewards)}, not a list or 1-d tensor (one per query): {shown(rewards)}"
        )
    rewards = values
    if any(isinstance(r, Mapping) for r in rewards):
        raise ValueError(
            f"{who} gave a dict per query; OpenRLHF's reply is one dict, {{'rewards': [one number per query], "
            f"'extra_logs': {{...}}}}"
        )
    if len(rewards) != count:
        raise ValueError(f"{who} gave {len(rewards)} rewards for {count} queries")
    infos: list[dict[str, Any]] = [{} for _ in rewards]
    if isinstance(logs, Mapping):
        for key, value in logs.items():
            values = _as_list(value)
            for i, info in enumerate(infos):
                info[str(key)] = values[i] if values is not None and len(values) == count else _plain(value)
    return [{"score": r, **({"info": info} if info else {})} for r, info in zip(rewards, infos)]


def _as_list(value: Any) -> list[Any] | None:
    """A list, tuple, numpy array or tensor as a list of Python values; anything else None."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1:
        return value.tolist()
    return None


def _plain(value: Any) -> Any:
    """A tensor or numpy value as Python numbers (a 0-d one as a number); other values unchanged."""
    if hasattr(value, "tolist") and getattr(value, "ndim", None) is not None:
        return value.tolist()
    return value


def openrlhf_request(items: list[Item]) -> tuple[list[str], list[str], list[Any]]:
    """OpenRLHF's queries, prompts and labels (a missing label as "", as OpenRLHF sends it)."""
    return (
        [openrlhf_query(p, r, m) for p, r, _, m in items],
        [openrlhf_prompt(p, m) for p, _, _, m in items],
        ["" if label is None else label for _, _, label, _ in items],
    )


def openrlhf_batch(fn: Callable[..., Any], name: str) -> BatchCall:
    """OpenRLHF's call: reward_func(queries, prompts, labels) over the batch, by position as
    OpenRLHF calls it."""

    def build(items: list[Item]) -> tuple[tuple, dict]:
        return openrlhf_request(items), {}

    def post(value: Any, _: dict, count: int) -> list[Any]:
        return openrlhf_results(value, count, f"OpenRLHF-style reward {name}")

    return BatchCall(build, post)


def _openrlhf(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    call = openrlhf_batch(fn, name)
    return _native(fn, name, lambda *item: call.build([item]), lambda value, kwargs: call.post(value, kwargs, 1)[0])


def _acceptor(fn: Callable[..., Any]) -> Callable[[str], bool]:
    params = inspect.signature(fn).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())

    @functools.cache
    def accepts(arg: str) -> bool:
        p = params.get(arg)
        return takes_kwargs or (p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

    return accepts
