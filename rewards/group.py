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

Each returns one result per response, in order: a number, a dict with "score" (and "info"; a verl
dict's other keys become its info), or None for a response it does not score (that sample fails).
A list of the wrong length, an exception (KeyboardInterrupt too), an exit (sys.exit, os._exit), a
`loop.stop()` or a call past `timeout_s` fails every sample of the group with the reason; other
groups go on. `GroupScorer` runs the calls, `max_concurrency` groups at once.

What the responses do not share is given per response: a native function's `metadata` holds the
group's shared row, and each key the job writes per response (PER_RESPONSE_KEYS: finish_reason,
response_ids, max_new_tokens, ...) or whose values differ between responses as a list, one value
per response in order (None where one lacks it). slime's `args` holds only the shared keys (each
sample has its own metadata; `args.rollout_max_response_len` is the group's largest budget); TRL
gets every column as a list and verl an `extra_info` per response anyway.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from types import SimpleNamespace
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
    verl_value,
)
from rewards.exit_guard import RewardLoop, call_as_reward, calling, exit_code, guard_os_exit, no_exit, reward_thread
from rewards.failure_text import describe_exception, exception_text, shown, type_name
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


class _StoppedLoop(Exception):
    """An async group call ran `loop.stop()` on the scorer's loop (GroupScorer._run_async)."""


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
            raise BadGroupReply(exception_text(exc)) from None

    def _native(self) -> BatchCall:
        pass_label, pass_metadata = _keyword_plan(self.fn, self.name, response_param="responses")

        def build(items: list[Item]) -> tuple[tuple, dict]:
            prompt, _, label, _ = items[0]  # a group shares its prompt, label and row
            shared, per_response = split_metadata([m for _, _, _, m in items])
            metadata = {**shared, **per_response}
            kwargs: dict[str, Any] = {"prompt": prompt, "responses": [r for _, r, _, _ in items]}
            if pass_label:
                kwargs["label"] = label
            if pass_metadata:
                kwargs["metadata"] = metadata
            return (), kwargs

        return BatchCall(build, self._listed)

    def _slime(self) -> BatchCall:
        def build(items: list[Item]) -> tuple[tuple, dict]:
            samples = [slime_sample(p, r, lab, m) for p, r, lab, m in items]  # each keeps its own metadata
            return (group_slime_args(items[0][2], [m for _, _, _, m in items]), samples), {}

        return BatchCall(build, self._listed)

    def _verl(self) -> BatchCall:
        accepts = _acceptor(self.fn)

        def build(items: list[Item]) -> tuple[tuple, dict]:
            fields = [verl_fields(r, label, m) for _, r, label, m in items]
            offered = {f"{key}s": [f[key] for f in fields] for key in fields[0]}
            return (), {k: v for k, v in offered.items() if accepts(k)}

        def post(value: Any, kwargs: dict, count: int) -> list[Any]:  # a dict's other keys: its info
            return [verl_value(v) for v in self._listed(value, kwargs, count)]

        return BatchCall(build, post)

    def _listed(self, value: Any, _: dict, count: int) -> list[Any]:
        values = _as_list(value)
        if values is None:
            raise TypeError(
                f"group reward {self.name} returned {type_name(value)} {shown(value)}, "
                f"not a list with one reward per response"
            )
        if len(values) != count:
            raise ValueError(
                f"group reward {self.name} returned {len(values)} rewards for a group of {count} responses"
            )
        return values


# What the job writes into a sample's metadata for its own response (slime.data.JOB_METADATA_KEYS
# lists them all; the others, prompt_text, prompt_messages, record_index and model_prompt, are the
# prompt's): never shared by a group's responses, even where their values happen to be equal.
PER_RESPONSE_KEYS = (
    *RESPONSE_KEYS,
    "finish_reason",
    "max_new_tokens",
    "reward_latency_s",
    "reward_info",
    "env_turns",
    "env_return",
    "env_end",
    "env_infos",
    "loss_masked",
    "generated_status",
)


def split_metadata(metadatas: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """What a group's responses share of their metadata, and the rest, one list per key with a value
    per response (None where one lacks it): PER_RESPONSE_KEYS and any key whose values differ."""
    first = metadatas[0]
    shared: dict[str, Any] = {}
    per_response: dict[str, list[Any]] = {}
    for key in dict.fromkeys(k for m in metadatas for k in m):
        if key in PER_RESPONSE_KEYS or not all(key in m and _same(m[key], first.get(key)) for m in metadatas):
            per_response[key] = [m.get(key) for m in metadatas]
        else:
            shared[key] = first[key]
    return shared, per_response


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # an array's == is elementwise
        return False


def group_slime_args(label: Any, metadatas: list[dict[str, Any]]) -> SimpleNamespace:
    """slime's `args` for a group: what its responses share (split_metadata), and as
    rollout_max_response_len the largest of their budgets (max_new_tokens)."""
    args = slime_args(label, split_metadata(metadatas)[0])
    budgets = [m["max_new_tokens"] for m in metadatas if isinstance(m.get("max_new_tokens"), int)]
    args.rollout_max_response_len = max(budgets, default=None)
    return args


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
        guard_os_exit()  # an os._exit in a group reward fails its group instead of ending this process
        self.hung = 0  # calls past their timeout still running (a thread cannot be stopped)
        self._lock = threading.Lock()
        self._loop: RewardLoop | None = None  # async functions' calls, started on first use
        self._loop_thread: threading.Thread | None = None

    def _run_async(self, awaitable: Any) -> Any:
        """An async fn's call on the shared loop; past timeout_s it is cancelled (unlike a thread, a
        coroutine can be stopped), so it ends at its next await."""
        with self._lock:
            if self._loop is None:
                self._loop = RewardLoop()
                self._loop_thread = threading.Thread(
                    target=call_as_reward, args=(self._loop.serve,), name="group-reward-loop", daemon=True
                )
                self._loop_thread.start()
        stopped = threading.Event()
        with calling(self._loop, stopped.set):  # a loop.stop() in the call sets `stopped` instead
            # no_exit: a SystemExit escaping a task would stop the loop every later call waits on
            future = asyncio.run_coroutine_threadsafe(no_exit(awaitable), self._loop)
        wait([future], timeout=self.timeout_s)
        if stopped.is_set() or not future.done():
            future.cancel()
            raise _StoppedLoop if stopped.is_set() else _CancelledAtTimeout
        return future.result()  # its value, or what it raised (a TimeoutError of its own is not a timeout)

    def score(self, groups: list[list[Item]]) -> list[list[RewardResult]]:
        return [f.result() for f in [self.pool.submit(self._limited, items) for items in groups]]

    def _limited(self, items: list[Item]) -> list[RewardResult]:
        """The call on a thread of its own, waited for at most timeout_s; past it, the group fails
        and the thread is left to finish (counted in `hung` until it does)."""
        box: list[list[RewardResult]] = []

        def run() -> None:
            try:
                with reward_thread():  # an os._exit in the call raises here (exit_guard)
                    results = self._timed(items)
            except BaseException as exc:  # the thread must end with results, or it would count as hung
                failure = f"group reward {self.call.name} failed: {describe_exception(exc)}"
                results = [RewardResult(None, failure, 0.0) for _ in items]
            with self._lock:
                box.append(results)
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
        except _StoppedLoop:
            failure = f"{who} stopped the event loop (loop.stop()); its async calls share that loop, so the call fails"
            return [RewardResult(None, failure, time.monotonic() - t0) for _ in items]
        except SystemExit as exc:  # sys.exit, or os._exit turned into one: not a timeout, nor the thread's end
            latency = time.monotonic() - t0
            return [RewardResult(None, f"{who} exited ({exit_code(exc)})", latency) for _ in items]
        except BaseException as exc:  # KeyboardInterrupt too: on this thread, only the reward raises it
            latency = time.monotonic() - t0
            return [RewardResult(None, f"{who} raised {describe_exception(exc)}", latency) for _ in items]
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
            loop.call_soon(loop.halt)  # after the cancellations have run one step

        loop.call_soon_threadsafe(cancel_all)
        thread.join(timeout=5)
        if not loop.is_running():
            loop.close()


__all__ = [
    "GROUP_STYLES",
    "PER_RESPONSE_KEYS",
    "GroupCall",
    "GroupRewardSpecError",
    "GroupScorer",
    "group_slime_args",
    "load_group_reward",
    "split_metadata",
]
