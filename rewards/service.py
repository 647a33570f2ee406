"""Where a reward runs, chosen by config (`reward.mode`): in the worker, in a Ray actor, or behind HTTP.

Every mode offers the same call to the rollout worker:

    service.submit(prompt, response, label, metadata) -> Future[RewardResult]   # never raises
    service.close()

* `in_process`: a `RewardRunner` in the worker (timeout and concurrency per call).
* `ray_actor`: one `RewardActor` per job (named, num_cpus=0, created by the first worker that
  needs it) runs the RewardRunner; workers send it batches. Ray restarts it when it dies; one
  that times out and then does not answer a health probe is hung, and is killed to be restarted.
* `http`: a reward server (`slime reward-serve SPEC --port N`, rewards/server.py) runs the
  RewardRunner; workers POST batches to `{url}/score` with the server's token
  (`reward.token`, sent as `Authorization: Bearer`).

The two remote modes share `RemoteRewardClient`: submissions queue up and leave in batches of at
most `batch_size` (whatever is waiting when a send slot frees up, so batches grow under load), at
most `max_concurrency` batches in flight. Each batch attempt has a timeout; connection errors,
timeouts, HTTP 429/5xx and a dead actor are retried with exponential backoff (base · 2^attempt,
capped, with jitter), then the batch's samples fail naming the last error. The reply is checked
item by item: a wrong number of results fails the whole batch; a NaN, a non-number or malformed
step rewards fail only their own sample.

`CachedRewards` wraps any mode with a bounded LRU of successful results keyed by
prompt + response + label + metadata (failures are not cached: a timeout may pass next time).

Names (`service.name`, in every failure message, log line and so in Redis and on the dashboard)
come from `describe_spec`/`redact_url`: a judge's `api_key` or a password in a URL never shows.
A reward server's own text (an error reply's body, a sample's failure reason) goes into them through
`printable_excerpt`: escape codes and line breaks shown escaped, the length capped.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, Protocol

from rewards.adapters import RESPONSE_KEYS, openrlhf_request, openrlhf_results
from rewards.mix import describe_spec, load_reward_spec, reads_model_text
from rewards.runner import RewardResult, RewardRunner, StepScores, check_reward_value
from slime.security import auth_headers, printable_excerpt, redact_url

log = logging.getLogger(__name__)


class RewardService(Protocol):
    name: str

    def submit(
        self, prompt: str, response: str, label: Any = None, metadata: dict[str, Any] | None = None
    ) -> Future: ...

    def close(self) -> None: ...


# --- wire format (shared by the HTTP server, the Ray actor and the client) ------------------------


def result_to_wire(result: RewardResult) -> dict[str, Any]:
    out: dict[str, Any] = {"reward": result.reward, "failure": result.failure, "latency_s": result.latency_s}
    if result.steps is not None:
        out["step_scores"] = list(result.steps.scores)
        out["step_ends"] = list(result.steps.ends)
    if result.info is not None:
        out["info"] = result.info
    return out


def result_from_wire(item: Any, who: str, response: str, latency_s: float) -> RewardResult:
    """One item of a remote reply as a RewardResult; anything malformed is a failure naming it."""
    if not isinstance(item, dict):
        return RewardResult(
            None, f"{who} sent a result of type {type(item).__name__}, not an object: {item!r:.80}", latency_s
        )
    if item.get("failure") is not None:
        return RewardResult(None, str(item["failure"]), _as_latency(item, latency_s))
    if "reward" not in item:
        return RewardResult(
            None, f"{who} sent a result without 'reward' or 'failure' (keys: {sorted(item)[:10]})", latency_s
        )
    value = {
        "score": item["reward"],
        "step_scores": item.get("step_scores"),
        "step_ends": item.get("step_ends"),
        "info": item.get("info"),
    }
    reward, failure, extras = check_reward_value(value, who, response)
    return RewardResult(reward, failure, _as_latency(item, latency_s), **extras)


def _as_latency(item: dict, default: float) -> float:
    value = item.get("latency_s")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def sample_to_wire(prompt: str, response: str, label: Any, metadata: dict[str, Any] | None) -> dict[str, Any]:
    return {"prompt": prompt, "response": response, "label": label, "metadata": metadata or {}}


MAX_REPLY_BYTES = 64 << 20  # a reward server's reply to one batch, read at most this far
MAX_REMOTE_FAILURE_CHARS = 2000  # a reward server's failure reason for one sample, as shown

# --- cache ---------------------------------------------------------------------------------------


def cache_key(prompt: str, response: str, label: Any, metadata: dict[str, Any] | None = None) -> str:
    """The metadata is part of the key: a reward may read the answer from a column other than the
    label (TRL's `solution`, verl's `reward_model`/`extra_info`, a task's tests) under a shared prompt."""
    # Not RESPONSE_KEYS: the response's text stands for them, and at long lengths serializing them
    # would cost the worker more than most rewards do.
    kept = {k: v for k, v in (metadata or {}).items() if k not in RESPONSE_KEYS}
    blob = json.dumps([prompt, response, label, kept], sort_keys=True, default=repr, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class CachedRewards:
    """A bounded LRU of successful results in front of any reward service."""

    def __init__(self, inner: RewardService, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"CachedRewards: max_entries must be >= 1, got {max_entries}")
        self.inner = inner
        self.name = inner.name
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, RewardResult] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, prompt: str, response: str, label: Any = None, metadata: dict[str, Any] | None = None) -> Future:
        key = cache_key(prompt, response, label, metadata)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
        if hit is not None:
            future: Future = Future()
            future.set_result(hit)
            return future
        future = self.inner.submit(prompt, response, label, metadata)
        future.add_done_callback(lambda f: self._store(key, f.result()))
        return future

    def _store(self, key: str, result: RewardResult) -> None:
        if not result.ok:
            return
        with self._lock:
            self._entries[key] = result
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self.inner.close()


# --- remote modes --------------------------------------------------------------------------------


class RetryableError(Exception):
    """A remote call that failed in a way that may pass on a later attempt."""


Transport = Callable[[list[dict[str, Any]], float], Awaitable[Any]]  # (samples, timeout_s) -> reply


class RemoteRewardClient:
    """Batches submissions to a remote reward (HTTP or Ray actor) with timeout, retry and backoff."""

    def __init__(
        self,
        name: str,
        make_transport: Callable[[], Transport],
        request_timeout_s: float,
        max_concurrency: int,
        batch_size: int,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        close_transport: Callable[[], Awaitable[None]] | None = None,
        on_timeout: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        """``on_timeout``: called after an attempt timed out, before the retry; it may find the
        service hung and restart it (the Ray actor mode does), saying so in what it returns."""
        if request_timeout_s <= 0 or max_concurrency < 1 or batch_size < 1 or max_retries < 0 or backoff_s < 0:
            raise ValueError(
                f"RemoteRewardClient({name}): need request_timeout_s > 0, max_concurrency >= 1, batch_size >= 1, "
                f"max_retries >= 0, backoff_s >= 0; got {request_timeout_s}, {max_concurrency}, {batch_size}, "
                f"{max_retries}, {backoff_s}"
            )
        self.name = name
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self.batch_size = batch_size
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.attempts = 0  # remote calls made, retries included
        self.retries = 0
        self._closed = False
        self._close_transport = close_transport
        self._on_timeout = on_timeout
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(make_transport, ready), name="reward-client", daemon=True
        )
        self._thread.start()
        ready.wait()

    def submit(self, prompt: str, response: str, label: Any = None, metadata: dict[str, Any] | None = None) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()
        if self._closed:
            future.set_result(
                RewardResult(None, f"reward service {self.name}: client is closed", 0.0, interrupted=True)
            )
            return future
        item = (sample_to_wire(prompt, response, label, metadata), future)
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # loop closed under a concurrent close()
            future.set_result(
                RewardResult(None, f"reward service {self.name}: client is closed", 0.0, interrupted=True)
            )
        return future

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=5.0)

    # --- loop thread ---

    def _run(self, make_transport: Callable[[], Transport], ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._queue: asyncio.Queue[tuple[dict, Future]] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._transport = make_transport()
        ready.set()
        try:
            self._loop.run_until_complete(self._dispatch())
        finally:
            self._loop.close()

    async def _dispatch(self) -> None:
        slots = asyncio.Semaphore(self.max_concurrency)
        inflight: set[asyncio.Task] = set()
        stop = asyncio.ensure_future(self._stop.wait())
        while True:
            get = asyncio.ensure_future(self._queue.get())
            await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stop.done():
                get.cancel()
                break
            batch = [get.result()]
            await slots.acquire()  # while all slots are busy, more samples queue up for this batch
            while len(batch) < self.batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            task = asyncio.ensure_future(self._send(batch))
            inflight.add(task)
            task.add_done_callback(lambda t: (inflight.discard(t), slots.release()))
        for task in inflight:
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)
        leftover = [self._queue.get_nowait() for _ in range(self._queue.qsize())]
        for _, future in leftover:
            _resolve(
                future,
                RewardResult(None, f"reward service {self.name}: client closed before sending", 0.0, interrupted=True),
            )
        if self._close_transport is not None:
            await self._close_transport()

    async def _send(self, batch: list[tuple[dict, Future]]) -> None:
        samples = [s for s, _ in batch]
        started = time.monotonic()
        try:
            reply = await self._call_with_retries(samples)
        except asyncio.CancelledError:
            for _, future in batch:
                _resolve(
                    future,
                    RewardResult(None, f"reward service {self.name}: client closed mid-call", 0.0, interrupted=True),
                )
            raise
        except Exception as exc:  # retries exhausted, or an error not worth retrying
            for _, future in batch:
                _resolve(future, RewardResult(None, f"reward service {self.name}: {exc}", time.monotonic() - started))
            return
        latency = time.monotonic() - started
        who = f"reward service {self.name}"
        results = reply.get("results") if isinstance(reply, dict) else reply
        if not isinstance(results, list) or len(results) != len(batch):
            got = f"{len(results)} results" if isinstance(results, list) else f"a {type(reply).__name__}"
            why = f"{who} answered {got} for {len(batch)} samples"
            for _, future in batch:
                _resolve(future, RewardResult(None, why, latency))
            return
        for (sample, future), item in zip(batch, results):
            _resolve(future, result_from_wire(item, who, sample["response"], latency))

    async def _call_with_retries(self, samples: list[dict]) -> Any:
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries += 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            self.attempts += 1
            try:
                return await asyncio.wait_for(self._transport(samples, self.request_timeout_s), self.request_timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                last = RetryableError(f"timed out after {self.request_timeout_s:g}s")
                restarted = await self._on_timeout() if self._on_timeout is not None else None
                if restarted:
                    last = RetryableError(f"timed out after {self.request_timeout_s:g}s; {restarted}")
            except RetryableError as exc:
                last = exc
            log.warning("reward service %s: attempt %d failed: %s", self.name, attempt + 1, last)
        raise RuntimeError(f"failed after {self.max_retries + 1} attempts; last error: {last}")


def _resolve(future: Future, result: RewardResult) -> None:
    if not future.done():
        future.set_result(result)


def http_transport(
    url: str, token: str | None = None, wire_format: str = "slime"
) -> tuple[Callable[[], Transport], Callable[[], Awaitable[None]]]:
    """POST {url}/score with {"samples": [...]} and the server's token; made inside the client's
    loop (httpx is loop-bound). ``wire_format="openrlhf"``: POST to `url` itself OpenRLHF's remote
    reward-model request, {"query": [...], "prompts": [...], "labels": [...]}, and read its reply,
    {"rewards": [...], "extra_logs"?: {...}} (rewards.adapters.openrlhf_results)."""
    import httpx

    holder: dict[str, httpx.AsyncClient] = {}
    endpoint = url if wire_format == "openrlhf" else url.rstrip("/") + "/score"
    shown = redact_url(endpoint)

    def make() -> Transport:
        holder["client"] = httpx.AsyncClient(timeout=None, headers=auth_headers(token))

        async def call(samples: list[dict], timeout_s: float) -> Any:
            if wire_format != "openrlhf":
                # The response again (RESPONSE_KEYS) stays home: at long lengths its token ids alone would
                # pass the server's body limit (a TRL completion_ids reward runs in_process or as ray_actor).
                sent = [
                    {**s, "metadata": {k: v for k, v in s["metadata"].items() if k not in RESPONSE_KEYS}}
                    for s in samples
                ]
                reply = await _post_json(holder["client"], endpoint, {"samples": sent}, shown, timeout_s, len(samples))
                return _printable_failures(reply)
            items = [(s["prompt"], s["response"], s["label"], s["metadata"]) for s in samples]
            queries, prompts, labels = openrlhf_request(items)
            body = {"query": queries, "prompts": prompts, "labels": labels}
            reply = await _post_json(holder["client"], endpoint, body, shown, timeout_s, len(samples))
            try:
                results = openrlhf_results(reply, len(samples), f"POST {shown}")
            except (TypeError, ValueError) as exc:  # a broken reply fails this batch, not retried
                raise RuntimeError(str(exc)) from None
            return {
                "results": [{"reward": r["score"], **({"info": r["info"]} if "info" in r else {})} for r in results]
            }

        return call

    async def close() -> None:
        if "client" in holder:
            await holder["client"].aclose()

    return make, close


async def _post_json(client: Any, endpoint: str, body: dict, shown: str, timeout_s: float, count: int) -> Any:
    """POST `body` as JSON; the reply's JSON. Connection errors, 429 and 5xx are retryable; other
    statuses, an oversized reply and one that is not JSON are not."""
    import httpx

    try:
        async with client.stream("POST", endpoint, json=body, timeout=timeout_s) as resp:
            status, reply = resp.status_code, bytearray()
            async for part in resp.aiter_bytes():
                reply += part
                if len(reply) > MAX_REPLY_BYTES:  # a hostile or broken server: not the worker's memory
                    raise RuntimeError(
                        f"POST {shown}: the reply is over {MAX_REPLY_BYTES >> 20} MiB for {count} samples (not retried)"
                    )
    except httpx.TransportError as exc:  # connect, read, protocol errors
        raise RetryableError(f"POST {shown}: {type(exc).__name__}: {redact_url(str(exc))}") from None
    text = reply.decode("utf-8", errors="replace")
    if status == 429 or status >= 500:
        raise RetryableError(f"POST {shown}: HTTP {status}: {printable_excerpt(text, 200)}")
    if status in (401, 403):
        raise RuntimeError(
            f"POST {shown}: HTTP {status} (not retried): the reward server wants its token; set reward.token: "
            f"{printable_excerpt(text, 200)}"
        )
    if status != 200:
        raise RuntimeError(f"POST {shown}: HTTP {status} (not retried): {printable_excerpt(text, 300)}")
    try:
        return json.loads(text)
    except ValueError:
        raise RuntimeError(f"POST {shown}: reply is not JSON: {printable_excerpt(text, 200)}") from None


def _printable_failures(reply: Any) -> Any:
    """The reply with each sample's failure reason made printable: these reasons are logged, printed
    under the progress bar and stored with the sample, and a server we do not run could write anything."""
    results = reply.get("results") if isinstance(reply, dict) else reply
    for item in results if isinstance(results, list) else ():
        if isinstance(item, dict) and isinstance(item.get("failure"), str):
            item["failure"] = printable_excerpt(item["failure"], MAX_REMOTE_FAILURE_CHARS)
    return reply


# --- Ray actor mode ------------------------------------------------------------------------------


class RewardActor:
    """Runs one reward for the whole job; the workers call `score(samples)` with batches."""

    def __init__(self, spec: str | dict, timeout_s: float, max_concurrency: int) -> None:
        self.runner = RewardRunner(load_reward_spec(spec), timeout_s, max_concurrency, name=describe_spec(spec))

    async def score(self, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        futures = [self.runner.submit(s["prompt"], s["response"], s.get("label"), s.get("metadata")) for s in samples]
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        return [result_to_wire(r) for r in results]

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "reward": self.runner.name, "hung_calls": self.runner.hung_calls, "pid": os.getpid()}


def ray_transport(actor: Any) -> Callable[[], Transport]:
    def make() -> Transport:
        import ray

        async def call(samples: list[dict], timeout_s: float) -> Any:
            try:
                return await actor.score.remote(samples)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                raise RetryableError(f"reward actor unavailable: {type(exc).__name__}: {exc}") from exc

        return call

    return make


HEALTH_PROBE_S = 15.0  # longer than a restart of the actor takes (a probe may land in one)
ACTOR_MAX_RESTARTS = 10


def ray_hang_check(actor: Any, probe_s: float = HEALTH_PROBE_S) -> Callable[[], Awaitable[str | None]]:
    """After a timed-out call: an actor that does not answer `health` either is hung (stopped,
    deadlocked, its event loop blocked by user code), not merely slow. Kill it so that Ray restarts
    it; the caller retries the batch on the new one."""

    async def check() -> str | None:
        import ray

        try:
            await asyncio.wait_for(actor.health.remote(), probe_s)
            return None
        except (asyncio.TimeoutError, TimeoutError):
            ray.kill(actor, no_restart=False)
            message = f"reward actor hung (no health answer in {probe_s:g}s): killed, Ray restarts it"
            log.warning(message)
            return message
        except Exception:  # dead or restarting: Ray handles it
            return None

    return check


def reward_actor(job_name: str, spec: str | dict, timeout_s: float, max_concurrency: int) -> Any:
    """The job's reward actor, created on first use (num_cpus=0: it waits on user code, not on a core)."""
    import ray

    cls = ray.remote(num_cpus=0, max_restarts=ACTOR_MAX_RESTARTS, max_concurrency=1000)(RewardActor)
    return cls.options(name=f"slime-reward-{job_name}", get_if_exists=True).remote(spec, timeout_s, max_concurrency)


# --- from config ---------------------------------------------------------------------------------


def wants_model_text(cfg: Any) -> bool:
    """Whether the samples `cfg` (RewardConfig, scope sample) scores need metadata["model_prompt"]
    and ["model_response"]: an OpenRLHF reward server, or an OpenRLHF-style reward here or in
    the Ray actor (one behind `slime reward-serve` is the server's: it scores prompt + response)."""
    if cfg.mode == "http":
        return cfg.http_format == "openrlhf"
    return reads_model_text(cfg.fn)


def make_reward_service(cfg: Any, job_name: str) -> RewardService:
    """The reward service `cfg` (slime.config.RewardConfig) asks for, cache included."""
    service: RewardService
    request_timeout = cfg.request_timeout_s if cfg.request_timeout_s is not None else 2 * cfg.timeout_s + 5
    if cfg.mode == "in_process":
        service = RewardRunner(load_reward_spec(cfg.fn), cfg.timeout_s, cfg.max_concurrency, name=describe_spec(cfg.fn))
    elif cfg.mode == "ray_actor":
        actor = reward_actor(job_name, cfg.fn, cfg.timeout_s, cfg.max_concurrency)
        service = RemoteRewardClient(
            f"ray actor slime-reward-{job_name} ({describe_spec(cfg.fn)})",
            ray_transport(actor),
            request_timeout,
            cfg.max_concurrency,
            cfg.batch_size,
            cfg.max_retries,
            cfg.backoff_s,
            on_timeout=ray_hang_check(actor, max(5.0, min(HEALTH_PROBE_S, request_timeout))),
        )
    elif cfg.mode == "http":
        make, close = http_transport(cfg.url, cfg.token, cfg.http_format)
        service = RemoteRewardClient(
            redact_url(cfg.url),
            make,
            request_timeout,
            cfg.max_concurrency,
            cfg.batch_size,
            cfg.max_retries,
            cfg.backoff_s,
            close_transport=close,
        )
    else:
        raise ValueError(f"reward.mode: unknown mode {cfg.mode!r}; choose in_process, ray_actor or http")
    return CachedRewards(service, cfg.cache_size) if cfg.cache_size > 0 else service


__all__ = [
    "CachedRewards",
    "RemoteRewardClient",
    "RetryableError",
    "RewardActor",
    "RewardService",
    "StepScores",
    "http_transport",
    "make_reward_service",
    "wants_model_text",
]
