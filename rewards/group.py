"""Group rewards (`reward.scope: group`): one call per complete group, the prompt's responses
together, one reward per response back. What slime's `--group-rm` does, and what a TRL reward
function sees when it compares completions: rank, pairwise-judge, diversity and length-relative
rewards.

`load_group_reward(spec)` loads a function and detects its style from its parameter names:

    native   has parameters `prompt` and `responses`   -> fn(prompt, responses, label, metadata)
                                                          (label/metadata only if it names them)
    slime    first two parameters are `args, samples`   -> rm(args, samples)  (slime's batched rm)
    TRL      has `completions` or `completion_ids`      -> f(prompts=[...], completions=[...], ...)
    OpenRLHF has `queries`, `prompts` and `labels`      -> reward_func(queries, prompts, labels)
    verl     has `solution_strs` and `ground_truths`    -> compute_score(data_sources, solution_strs,
                                                          ground_truths, extra_infos)  (its batch
                                                          reward manager's call)

Each returns one result per response, in order: a number, a dict with "score" (and "info"), or
None for a response it does not score (that sample fails). A list of the wrong length, an
exception or a call past `timeout_s` fails every sample of the group with the reason; other groups
go on. `GroupScorer` runs the calls, `max_concurrency` groups at once.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from rewards.adapters import (
    ACCEPTED_SIGNATURES,
    RESPONSE_KEYS,
    BatchCall,
    Item,
    RewardSignatureError,
    _acceptor,
    _as_list,
    matching_styles,
    openrlhf_batch,
    parameter_names,
    slime_args,
    slime_sample,
    trl_batch,
    verl_fields,
)
from rewards.plugin import load_function
from rewards.runner import RewardResult, _describe, _keyword_plan, check_reward_value
from slime.errors import UserError

GROUP_STYLES = ("native", "slime", "trl", "openrlhf", "verl")

GROUP_SIGNATURES = (
    "native `fn(prompt, responses, label, metadata) -> list` (label/metadata optional, sync or async); "
    "slime `async def rm(args, samples) -> list`; TRL `f(completions, **kwargs) -> list`; "
    "OpenRLHF `reward_func(queries, prompts, labels)`; "
    "verl `compute_score(data_sources, solution_strs, ground_truths, extra_infos)`"
)


class _CancelledAtTimeout(Exception):
    """An async group call cancelled at reward.timeout_s (GroupScorer._run_async)."""


class BadGroupReply(ValueError):
    """What a group reward returned does not give one reward per response."""


class GroupRewardSpecError(UserError, ValueError):
    """A reward.fn that cannot score whole groups."""

    hint = "docs/rewards.md, 'Group rewards', lists what reward.scope=group takes"


def load_group_reward(spec: Any) -> GroupCall:
    """`spec`: `module:function` / `file.py:function`, or {fn, kwargs, style} (a factory called once
    with kwargs). A mix or route spec is refused: they combine per-sample rewards."""
    style = None
    if isinstance(spec, Mapping):
        if "fn" not in spec or set(spec) - {"fn", "kwargs", "style"}:
            raise GroupRewardSpecError(
                f"reward.fn with reward.scope=group is one function (`module:function`, or {{fn, kwargs, style}}); "
                f"got the keys {sorted(map(str, spec))} (mix and route combine per-sample rewards)"
            )
        style = spec.get("style")
        fn = load_function(spec["fn"])
        name = str(spec["fn"])
        if spec.get("kwargs") is not None:
            try:
                fn = fn(**spec["kwargs"])
            except Exception as exc:
                raise GroupRewardSpecError(f"reward.fn: {name}(**kwargs) failed: {type(exc).__name__}: {exc}") from exc
    else:
        name = str(spec)
        fn = load_function(name)
    return GroupCall(fn, name, style)


def detect_group_style(fn: Callable[..., Any], name: str) -> str:
    sig, names, positional = parameter_names(fn, f"group reward {name}", GROUP_SIGNATURES)
    matches = matching_styles(names, positional, group=True)
    if len(matches) == 1:
        return matches[0]
    why = f"matches several styles ({', '.join(matches)})" if matches else "matches no group style"
    hint = ""
    if "response" in names or positional[:2] == ["args", "sample"]:
        hint = " It looks like a per-sample reward: leave reward.scope at 'sample' for it."
    raise RewardSignatureError(
        f"group reward {name}{sig} {why}; choose its style in the config, reward.fn={{fn: {name}, style: S}}, "
        f"S one of {', '.join(GROUP_STYLES)}. "
        f"Group signatures: {GROUP_SIGNATURES}.{hint} (Per-sample signatures: {ACCEPTED_SIGNATURES})"
    )


class GroupCall:
    """`fn` in its style as `call(items) -> one result per item` (sync; an async fn runs to completion)."""

    def __init__(self, fn: Callable[..., Any], name: str, style: str | None = None) -> None:
        self.fn, self.name = fn, name or _describe(fn)
        self.style = style or detect_group_style(fn, self.name)
        if self.style not in GROUP_STYLES:
            raise GroupRewardSpecError(
                f"group reward {name}: unknown style {self.style!r}; choose one of {GROUP_STYLES}"
            )
        self.batch: BatchCall = {
            "native": self._native,
            "slime": self._slime,
            "trl": lambda: trl_batch(fn, self.name),
            "openrlhf": lambda: openrlhf_batch(fn, self.name),
            "verl": self._verl,
        }[self.style]()

    def __call__(self, items: list[Item], run_async: Callable[[Any], Any] | None = None) -> list[Any]:
        """`run_async(awaitable)`: where an async fn's calls run (GroupScorer: one loop for all of
        them, so a client it keeps across calls stays on its loop); default, a loop per call."""
        args, kwargs = self.batch.build(items)
        value = self.fn(*args, **kwargs)
        if inspect.isawaitable(value):
            value = run_async(value) if run_async is not None else asyncio.run(_awaited(value))
        try:
            return self.batch.post(value, kwargs, len(items))
        except (TypeError, ValueError) as exc:
            raise BadGroupReply(str(exc)) from None

    def _native(self) -> BatchCall:
        pass_label, pass_metadata = _keyword_plan(self.fn, self.name, response_param="responses")

        def build(items: list[Item]) -> tuple[tuple, dict]:
            prompt, _, label, metadata = items[0]  # a group shares its prompt, label and row
            metadata = _shared(metadata)
            kwargs: dict[str, Any] = {"prompt": prompt, "responses": [r for _, r, _, _ in items]}
            if pass_label:
                kwargs["label"] = label
            if pass_metadata:
                kwargs["metadata"] = metadata
            return (), kwargs

        return BatchCall(build, self._listed)

    def _slime(self) -> BatchCall:
        def build(items: list[Item]) -> tuple[tuple, dict]:
            _, _, label, metadata = items[0]
            samples = [slime_sample(p, r, lab, m) for p, r, lab, m in items]
            return (slime_args(label, _shared(metadata)), samples), {}  # each sample keeps its own metadata

        return BatchCall(build, self._listed)

    def _verl(self) -> BatchCall:
        accepts = _acceptor(self.fn)

        def build(items: list[Item]) -> tuple[tuple, dict]:
            fields = [verl_fields(r, label, m) for _, r, label, m in items]
            offered = {f"{key}s": [f[key] for f in fields] for key in fields[0]}
            return (), {k: v for k, v in offered.items() if accepts(k)}

        return BatchCall(build, self._listed)  # a dict per response gives its "score" (check_reward_value)

    def _listed(self, value: Any, _: dict, count: int) -> list[Any]:
        values = _as_list(value)
        if values is None:
            raise TypeError(
                f"group reward {self.name} returned {type(value).__name__} {value!r:.80}, "
                f"not a list with one reward per response"
            )
        if len(values) != count:
            raise ValueError(
                f"group reward {self.name} returned {len(values)} rewards for a group of {count} responses"
            )
        return values


def _shared(metadata: dict[str, Any]) -> dict[str, Any]:
    """What the responses of a group share of a sample's metadata: all but its own response."""
    return {k: v for k, v in metadata.items() if k not in RESPONSE_KEYS}


async def _awaited(value: Any) -> Any:
    return await value


class GroupScorer:
    """Scores groups with a GroupCall, `max_concurrency` at once, each call within `timeout_s` of
    its own start (a group waiting for a free slot is not timed yet)."""

    def __init__(self, call: GroupCall, timeout_s: float, max_concurrency: int) -> None:
        self.call, self.timeout_s = call, timeout_s
        # metadata["model_prompt"] and ["model_response"] are made for an OpenRLHF-style call only
        self.reads_model_text = call.style == "openrlhf"
        self.pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="group-reward")
        self.hung = 0  # calls past their timeout still running (a thread cannot be stopped)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # async functions' calls, started on first use
        self._loop_thread: threading.Thread | None = None

    def _run_async(self, awaitable: Any) -> Any:
        """An async fn's call on the shared loop; past timeout_s it is cancelled (unlike a thread, a
        coroutine can be stopped), so it ends at its next await."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(
                    target=self._loop.run_forever, name="group-reward-loop", daemon=True
                )
                self._loop_thread.start()
        future = asyncio.run_coroutine_threadsafe(_awaited(awaitable), self._loop)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:  # (the builtin TimeoutError: a reward may raise one of its own)
            future.cancel()
            raise _CancelledAtTimeout from None

    def score(self, groups: list[list[Item]]) -> list[list[RewardResult]]:
        return [f.result() for f in [self.pool.submit(self._limited, items) for items in groups]]

    def _limited(self, items: list[Item]) -> list[RewardResult]:
        """The call on a thread of its own, waited for at most timeout_s; past it, the group fails
        and the thread is left to finish (counted in `hung` until it does)."""
        box: list[list[RewardResult]] = []

        def run() -> None:
            box.append(self._timed(items))
            with self._lock:
                if late.is_set():
                    self.hung -= 1

        late = threading.Event()
        thread = threading.Thread(target=run, name="group-reward-call", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        with self._lock:
            if box:
                return box[0]
            late.set()
            self.hung += 1
        return [RewardResult(None, self._too_slow(), self.timeout_s) for _ in items]

    def _too_slow(self) -> str:
        return f"group reward {self.call.name} took longer than reward.timeout_s={self.timeout_s:g}"

    def _timed(self, items: list[Item]) -> list[RewardResult]:
        who = f"group reward {self.call.name}"
        t0 = time.monotonic()
        try:
            values = self.call(items, self._run_async)
        except BadGroupReply as exc:
            return [RewardResult(None, str(exc), time.monotonic() - t0) for _ in items]
        except _CancelledAtTimeout:
            return [RewardResult(None, self._too_slow(), self.timeout_s) for _ in items]
        except Exception as exc:
            latency = time.monotonic() - t0
            return [RewardResult(None, f"{who} raised {type(exc).__name__}: {exc}", latency) for _ in items]
        latency = time.monotonic() - t0
        results = []
        for (_, response, _, _), value in zip(items, values):
            if value is None:  # TRL's way to say a reward does not apply; it has no reward here
                results.append(RewardResult(None, f"{who} gave None for this response: it does not score it", latency))
                continue
            reward, failure, extras = check_reward_value(value, who, response)
            results.append(RewardResult(reward, failure, latency, **extras))
        return results

    def close(self) -> None:
        """Stop taking groups; async calls still running are cancelled and the loop closed (a sync
        call past its timeout cannot be stopped: its daemon thread ends with the process)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        loop, thread = self._loop, self._loop_thread
        if loop is None or thread is None:
            return

        def cancel_all() -> None:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.call_soon(loop.stop)  # after the cancellations have run one step

        loop.call_soon_threadsafe(cancel_all)
        thread.join(timeout=5)
        if not loop.is_running():
            loop.close()


__all__ = ["GROUP_STYLES", "GroupCall", "GroupRewardSpecError", "GroupScorer", "load_group_reward"]
