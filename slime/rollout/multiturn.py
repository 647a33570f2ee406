"""Multi-turn rollout: model turns and environment turns alternate in one trajectory. The
worker's machinery for driving an env (the contract is envs/contract.py).

Token-in/token-out. A model turn's tokens are exactly what the engine produced (loss mask 1, the
engine's logprobs); only the observation *text* is tokenised (loss mask 0, logprob 0). The next
model turn is a resumed request over prompt + every response token so far: nothing the engine made
is decoded and encoded again (the action text handed to the env never goes back into the stream).

Turn state lives in the stored sample itself, so an APRIL-aborted trajectory resumes in the right
turn on any worker: the model turns are the runs of loss mask 1, the observations the runs of
mask 0 (so a non-final observation must be at least one token). A trailing mask-1 run is a finished
turn whose observation is still owed when it ends with a stop token or has `max_turn_tokens`
tokens, or left the episode no room (`room`: max_new_tokens, max_episode_tokens, the model's
context; the uninterrupted episode stepped the env there too); otherwise the model continues it.

The env's own state comes back one of two ways on resume:
- snapshot: an env with `snapshot() -> dict` and `restore(sample, snapshot)` (envs/swe.py: a
  workspace and its tool history) has its snapshot stored with every observation, in the same
  buffer write (`append_chunk(env_state=...)`), tagged with the transcript length it belongs to.
  The resumed episode is `reset` then `restore`d when that length is where the stored transcript's
  last observation ends: no tool runs again, and a job killed outright resumes the same way (the
  snapshot is in Redis with the tokens). Costly or non-deterministic tools need this.
- replay: any other env is rebuilt by `reset` plus a replay of the stored actions (their
  observations are discarded: the stored tokens are the record), so its steps should be
  deterministic in the action history. A snapshot that does not match the transcript (none
  written yet) also falls back to replay.
Either way the episode's return is the sum of the restored (or replayed) and the new step rewards
(`env.turn_rewards`: each on its turn's last token).

Env calls (construction, reset, replay, step) run on a small thread pool, never on the generation
thread; `MultiTurnRollout.poll` collects finished ones between two decode steps. The limits (env.*
in docs/configuration.md) end an episode as truncated, naming the limit; `step_timeout_s` per env
call fails the sample. An env that ends the episode itself may name why in
`info["end_reason"]` (a policy that wrote outside its workspace, looped).
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from envs.contract import Env
from rewards.plugin import load_function
from slime.buffer import ChunksLostError, LeaseLostError, TrajectoryStore
from slime.config import ConfigError, EnvConfig
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.rollout.env_threads import EnvCall, EnvThreads, awaited
from slime.rollout.observations import encode_observation
from slime.sample import Sample, Status, as_json


@dataclass
class TurnLayout:
    """Where a stored response stands, read from its loss mask (and the stop tokens) alone."""

    answered: list[tuple[int, int]]  # [start, end) of each model turn an observation already follows
    open_turn: tuple[int, int] | None  # the trailing model turn, no observation after it yet
    open_turn_finished: bool  # that turn is over: its observation is owed


def read_layout(sample: Sample, stop_ids: set[int], max_turn_tokens: int, room: int) -> TurnLayout:
    mask = sample.loss_mask
    runs: list[tuple[int, int, int]] = []  # (mask value, start, end)
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((int(mask[start]), start, i))
            start = i
    model_runs = [(s, e) for m, s, e in runs if m == 1]
    if not runs or runs[-1][0] == 0:
        return TurnLayout(model_runs, None, False)
    s, e = model_runs[-1]
    finished = int(sample.response_ids[e - 1]) in stop_ids or e - s >= max_turn_tokens or room <= 0
    return TurnLayout(model_runs[:-1], (s, e), finished)


@dataclass
class EpisodeEnd:
    status: Status  # COMPLETED (the env said done), TRUNCATED (a limit) or FAILED
    reason: str  # "done", the limit's name, or why it failed
    env_return: float  # sum of the env's step rewards
    turns: int  # model turns the env answered
    infos: list[dict[str, Any]] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)  # each answered turn's (env.turn_rewards)
    loss_masked: bool = False  # a truncated episode under env.truncated_episodes=mask

    def turn_rewards(self, loss_mask: np.ndarray) -> np.ndarray:
        """Step k's reward on the last token of model turn k (the k-th run of mask 1), zero elsewhere."""
        mask = np.asarray(loss_mask) > 0
        ends = np.flatnonzero(mask & ~np.append(mask[1:], False))  # each model run's last token
        rewards = np.zeros(len(mask), dtype=np.float32)
        if len(ends):  # a step past the runs (none expected) adds to the last one
            np.add.at(rewards, ends[np.minimum(np.arange(len(self.step_rewards)), len(ends) - 1)], self.step_rewards)
        return rewards

    def metadata(self) -> dict[str, Any]:
        # Step infos are the env's own dicts: keep the last few, JSON-safe.
        infos = as_json(self.infos[-8:])
        out = {"env_turns": self.turns, "env_return": self.env_return, "env_end": self.reason, "env_infos": infos}
        if self.loss_masked:
            out["loss_masked"] = f"truncated: {self.reason}"
        return out


@dataclass
class _EnvOutcome:
    observation_ids: list[int]  # appended with loss mask 0 (may be empty)
    end: EpisodeEnd | None = None
    env_state: str | None = None  # the env's snapshot after this step, stored with the observation


ENV_SNAPSHOT_INFOS = 8  # step infos carried in a snapshot (the episode's metadata keeps as many)


class EnvContractError(TypeError):
    """An env returned what the contract does not allow (envs/contract.py); it raised nothing."""


@dataclass(eq=False)
class _Episode:
    sample: Sample
    started_at: float
    env: Env | None = None
    turns_done: int = 0
    env_return: float = 0.0
    step_rewards: list[float] = field(default_factory=list)  # one per answered model turn
    infos: list[dict[str, Any]] = field(default_factory=list)
    turn_started_at: float = 0.0
    job: Future | None = None  # env work in flight; None while the model generates
    call: EnvCall | None = None  # the thread call behind job (None for a result known at once)
    limit: str | None = None  # a time limit that aborted the model turn

    def end(self, status: Status, reason: str) -> EpisodeEnd:
        return EpisodeEnd(status, reason, self.env_return, self.turns_done, self.infos, self.step_rewards)


class MultiTurnRollout:
    """The multi-turn state machine of one rollout worker. Every method except the pool jobs runs on
    the worker's generation thread (under its engine lock)."""

    def __init__(
        self,
        cfg: EnvConfig,
        tokenizer: Any,
        params: SamplingParams,
        buffer: TrajectoryStore,
        worker_id: str,
        max_seq_len: int | None = None,
        on_env_done: Callable[[], None] = lambda: None,
    ):
        if cfg.plugin is None:
            raise ValueError("MultiTurnRollout needs env.plugin (the env class, `package.module:Class`)")
        self.cfg = cfg
        self.env_class = load_function(cfg.plugin)
        try:  # a wrong keyword fails here, once, not every episode (and then the job) at its first turn
            inspect.signature(self.env_class).bind(**cfg.kwargs)
        except TypeError as exc:
            raise ConfigError(f"env.kwargs {sorted(cfg.kwargs)} do not fit {cfg.plugin}: {exc}") from None
        except ValueError:  # no signature to read (a builtin): the first episode will tell
            pass
        self.tokenizer = tokenizer
        # Fast tokenizers may raise "Already borrowed" when one is used by several threads at once.
        self.tokenizer_lock = threading.Lock()
        self.params = params
        self.stop_ids = set(params.stop_token_ids)
        self.buffer = buffer
        self.worker_id = worker_id
        self.max_seq_len = max_seq_len
        self.on_env_done = on_env_done  # wakes the generation loop when an env call completes
        self.threads = EnvThreads(cfg.max_concurrency, max_hung=4 * cfg.max_concurrency)
        self.episodes: dict[str, _Episode] = {}

    # ---- hooks called by the rollout worker -----------------------------------------------------
    def begin(self, sample: Sample) -> None:
        """A leased sample (new or resumed): build its env and find its turn, off the generation thread."""
        ep = _Episode(sample, started_at=time.time())
        self.episodes[sample.id] = ep
        self._submit(ep, self._restore, ep)

    def model_turn_ended(self, sample: Sample, finish_reason: str | None) -> bool:
        """The engine finished a model turn (its tokens are flushed). False: not ours to continue (a
        plain abort, or unknown): the caller releases or finalises it as usual."""
        ep = self.episodes.get(sample.id)
        if ep is None:
            return False
        if finish_reason == "abort" and ep.limit is None:
            del self.episodes[sample.id]
            return False
        if ep.limit is not None:
            self._submit_done(ep, _EnvOutcome([], ep.end(Status.TRUNCATED, ep.limit)))
        else:
            layout = self._layout(sample)
            self._submit(ep, self._step, ep, self._action_text(sample, layout.open_turn))
        return True

    def poll(self, version: int) -> list[tuple[Sample, GenerationRequest | EpisodeEnd]]:
        """Collect finished env work: append observations (loss mask 0) and say, per sample, what comes
        next: the next model turn's request, or the end of the episode."""
        out: list[tuple[Sample, GenerationRequest | EpisodeEnd]] = []
        now = time.time()
        for sid, ep in list(self.episodes.items()):
            if ep.job is None:
                continue
            if not ep.job.done():
                if (why := self._overdue(ep.call, now)) is None:
                    continue
                outcome = _EnvOutcome([], ep.end(Status.FAILED, why))
            else:
                try:
                    outcome = ep.job.result()
                except EnvContractError as exc:  # counted as "returned", not as an exception it raised
                    outcome = _EnvOutcome([], ep.end(Status.FAILED, f"env {self.cfg.plugin} returned {exc}"))
                except (Exception, SystemExit) as exc:  # sys.exit in an env (a wrapped CLI) fails its sample
                    outcome = _EnvOutcome(
                        [], ep.end(Status.FAILED, f"env {self.cfg.plugin} raised {type(exc).__name__}: {exc}")
                    )
            ep.job = None
            if outcome.observation_ids:
                ids = outcome.observation_ids
                try:
                    self.buffer.append_chunk(
                        sid,
                        self.worker_id,
                        ids,
                        np.zeros(len(ids)),
                        version,
                        loss_mask=0,
                        stored_length=ep.sample.response_length,
                        env_state=outcome.env_state,
                    )
                except (LeaseLostError, KeyError):
                    del self.episodes[sid]  # requeued meanwhile: another worker has it now
                    continue
                except ChunksLostError:  # Redis lost writes: the episode resumes from what is stored
                    del self.episodes[sid]
                    self.buffer.release_many([sid], self.worker_id)
                    continue
                ep.sample.append(ids, np.zeros(len(ids)), version, loss_mask=0)
            end = outcome.end or self._limit_end(ep, now)
            if end is not None:
                del self.episodes[sid]
                end.loss_masked = end.status == Status.TRUNCATED and self.cfg.truncated_episodes == "mask"
                out.append((ep.sample, end))
            else:
                out.append((ep.sample, self._next_request(ep)))
        return out

    def overdue(self, now: float | None = None) -> list[str]:
        """Samples whose model turn or episode ran past its time limit; the caller aborts them in the
        engine and they come back through model_turn_ended as truncated episodes."""
        now = time.time() if now is None else now
        ids = []
        for sid, ep in self.episodes.items():
            if ep.job is not None or ep.limit is not None:
                continue
            if self.cfg.max_turn_seconds is not None and now - ep.turn_started_at > self.cfg.max_turn_seconds:
                ep.limit = "max_turn_seconds"
            elif self.cfg.max_episode_seconds is not None and now - ep.started_at > self.cfg.max_episode_seconds:
                ep.limit = "max_episode_seconds"
            else:
                continue
            ids.append(sid)
        return ids

    def abort_env_turns(self) -> list[str]:
        """APRIL abort: forget every episode; returns those waiting on the env, for the caller to
        release (their stored tokens end with a finished model turn, so the resumed episode redoes
        that env step). Episodes in the engine come back as aborted chunks and are released there."""
        waiting = [sid for sid, ep in self.episodes.items() if ep.job is not None]
        for sid in waiting:
            self.episodes.pop(sid).job.cancel()
        return waiting

    def env_turn_ids(self) -> list[str]:
        """Samples waiting on the env (their leases need renewing like the engine's). Read off the
        generation thread's lock (lease renewal): the copy is one C call, so an abort that removes
        episodes meanwhile cannot change the dict under the loop."""
        return [sid for sid, ep in list(self.episodes.items()) if ep.job is not None]

    def drop(self, sample_id: str) -> None:
        self.episodes.pop(sample_id, None)

    def close(self) -> None:
        self.threads.close()

    # ---- generation-thread helpers --------------------------------------------------------------
    def _submit(self, ep: _Episode, fn, *args) -> None:
        ep.call = self.threads.submit(fn, *args)
        ep.job = ep.call.future
        ep.job.add_done_callback(lambda _: self.on_env_done())

    def _submit_done(self, ep: _Episode, outcome: _EnvOutcome) -> None:
        ep.job, ep.call = Future(), None
        ep.job.set_result(outcome)
        self.on_env_done()

    def _overdue(self, call: EnvCall | None, now: float) -> str | None:
        """Why a call still running fails its sample now, or None. Its limit counts from its start: a
        call queued behind others is not late. One past it is written off (a thread cannot be killed;
        its late result is ignored) and another thread takes its slot."""
        limit = self.cfg.step_timeout_s
        if call is None:
            return None
        if call.started_at is None:
            if self.threads.starved and now - call.queued_at > limit:
                call.future.cancel()  # it never runs: its sample has failed
                return (
                    f"no env thread free for env.step_timeout_s={limit}: {self.threads.hung} env calls hung past it "
                    "hold every thread (fix the hang; the job counts them as failures)"
                )
            return None
        if now - call.started_at <= limit:
            return None
        self.threads.write_off(call)
        return f"env call exceeded env.step_timeout_s={limit}"

    def _layout(self, sample: Sample) -> TurnLayout:
        return read_layout(sample, self.stop_ids, self.cfg.max_turn_tokens, self._room(sample)[0])

    def _turn_budget(self, sample: Sample) -> int:
        layout = self._layout(sample)
        open_tokens = 0
        if layout.open_turn is not None and not layout.open_turn_finished:
            open_tokens = layout.open_turn[1] - layout.open_turn[0]
        return min(self.cfg.max_turn_tokens - open_tokens, self._room(sample)[0])

    def _room(self, sample: Sample) -> tuple[int, str]:
        """Tokens the episode may still grow by, and the limit that sets it."""
        rooms = [(sample.remaining_tokens, "max_new_tokens")]
        used = len(sample.prompt_ids) + sample.response_length
        if self.cfg.max_episode_tokens is not None:
            rooms.append((self.cfg.max_episode_tokens - used, "max_episode_tokens"))
        if self.max_seq_len is not None:
            rooms.append((self.max_seq_len - used, "max_seq_len"))
        return min(rooms)

    def _limit_end(self, ep: _Episode, now: float) -> EpisodeEnd | None:
        if self.cfg.max_episode_seconds is not None and now - ep.started_at > self.cfg.max_episode_seconds:
            return ep.end(Status.TRUNCATED, "max_episode_seconds")
        if self._turn_budget(ep.sample) <= 0:
            return ep.end(Status.TRUNCATED, self._room(ep.sample)[1])
        return None

    def _next_request(self, ep: _Episode) -> GenerationRequest:
        sample = ep.sample
        # The engine counts max_new_tokens over the whole response, resumed tokens included.
        params = replace(self.params, max_new_tokens=sample.response_length + self._turn_budget(sample))
        ep.turn_started_at = time.time()
        # keep_kv_after_finish: the next turn comes back as this request plus the observation; the
        # built-in engine then feeds only the observation onto the kept cache (rollout.kept_kv_tokens).
        # The turn begins after the last observation token: an observation that ends in a stop token
        # or string is not a turn that stopped (every later turn ended at once, with no tokens).
        observed = np.flatnonzero(sample.loss_mask == 0)
        return GenerationRequest(
            sample.id,
            sample.prompt_ids.tolist(),
            params,
            sample.response_ids.tolist(),
            keep_kv_after_finish=True,
            turn_start=int(observed[-1]) + 1 if observed.size else 0,
        )

    def _action_text(self, sample: Sample, span: tuple[int, int] | None) -> str:
        if span is None:
            return ""
        ids = [t for t in sample.response_ids[span[0] : span[1]].tolist() if t not in self.stop_ids]
        with self.tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- pool jobs ------------------------------------------------------------------------------
    def _restore(self, ep: _Episode) -> _EnvOutcome:
        ep.env = self.env_class(**self.cfg.kwargs)
        observation = awaited(ep.env.reset(ep.sample))
        if not isinstance(observation, str):
            raise EnvContractError(f"from reset a {type(observation).__name__}, expected str (the observation)")
        sample = ep.sample
        if sample.response_length == 0:
            return _EnvOutcome(self._encode_observation(observation, sample))
        layout = self._layout(sample)
        if not self._restore_snapshot(ep, layout):
            if layout.answered:
                self.buffer.incr_stat("env_replays")
            for span in layout.answered:  # replay: rebuild the env's state; the stored observations stand
                _, _, done, info = self._call_step(ep, self._action_text(sample, span))
                if done:
                    return _EnvOutcome([], ep.end(Status.COMPLETED, _end_reason(info)))
        if layout.open_turn is not None and layout.open_turn_finished:
            return self._step(ep, self._action_text(sample, layout.open_turn))
        return _EnvOutcome([])

    def _restore_snapshot(self, ep: _Episode, layout: TurnLayout) -> bool:
        """Restore the env from the snapshot stored with the transcript's last observation; False when
        the env keeps none or the stored one belongs to another transcript length (then: replay)."""
        restore = getattr(ep.env, "restore", None)
        if restore is None or not layout.answered:
            return False
        raw = self.buffer.env_state(ep.sample.id)
        stored = json.loads(raw) if raw else None
        # The snapshot belongs to the transcript up to the end of the observation it was stored with.
        boundary = layout.open_turn[0] if layout.open_turn is not None else ep.sample.response_length
        if stored is None or stored["at_length"] != boundary or stored["turns"] != len(layout.answered):
            return False
        restore(ep.sample, stored["state"])
        ep.turns_done, ep.env_return, ep.infos = stored["turns"], stored["env_return"], stored["infos"]
        ep.step_rewards = stored.get("step_rewards") or [0.0] * (ep.turns_done - 1) + [ep.env_return]  # older
        self.buffer.incr_stat("env_snapshot_restores")
        return True

    def _step(self, ep: _Episode, action: str) -> _EnvOutcome:
        observation, _, done, info = self._call_step(ep, action)
        if done:
            return _EnvOutcome([], ep.end(Status.COMPLETED, _end_reason(info)))
        if ep.turns_done >= self.cfg.max_turns:
            return _EnvOutcome([], ep.end(Status.TRUNCATED, "max_turns"))
        ids = self._encode_observation(observation, ep.sample)
        if not ids:
            if self._room(ep.sample)[0] <= 1:
                return _EnvOutcome([], ep.end(Status.TRUNCATED, self._room(ep.sample)[1]))
            raise EnvContractError(
                "from step an empty observation with done=False; a non-final observation needs at "
                "least one token (turn boundaries are read from the loss mask)"
            )
        return _EnvOutcome(ids, env_state=self._snapshot(ep, ep.sample.response_length + len(ids)))

    def _snapshot(self, ep: _Episode, at_length: int) -> str | None:
        snapshot = getattr(ep.env, "snapshot", None)
        if snapshot is None:
            return None
        state = {
            "at_length": at_length,
            "turns": ep.turns_done,
            "env_return": ep.env_return,
            "step_rewards": ep.step_rewards,
            "infos": as_json(ep.infos[-ENV_SNAPSHOT_INFOS:]),
            "state": snapshot(),
        }
        try:
            return json.dumps(state)
        except TypeError as exc:
            raise TypeError(f"{type(ep.env).__name__}.snapshot() must return JSON-serialisable data: {exc}") from None

    def _call_step(self, ep: _Episode, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        result = awaited(ep.env.step(action))
        if not (isinstance(result, tuple) and len(result) == 4):
            what = (
                f"{type(result).__name__} of {len(result)}"
                if isinstance(result, (tuple, list))
                else type(result).__name__
            )
            raise EnvContractError(f"from step a {what}, expected the tuple (observation, reward, done, info)")
        observation, reward, done, info = result
        if not isinstance(observation, str):
            raise EnvContractError(f"from step an observation of type {type(observation).__name__}, expected str")
        if not isinstance(reward, numbers.Real) or isinstance(reward, (bool, np.bool_)):  # numpy floats too
            raise EnvContractError(f"from step a reward of type {type(reward).__name__}, expected a number")
        if not math.isfinite(float(reward)):  # one NaN would make every weight NaN at the next update
            raise EnvContractError(f"from step a reward of {float(reward)}, not a finite number")
        if info is not None and not isinstance(info, Mapping):
            raise EnvContractError(f"from step an info of type {type(info).__name__}, expected a dict")
        ep.turns_done += 1
        ep.env_return += float(reward)
        ep.step_rewards.append(float(reward))
        ep.infos.append(dict(info or {}))
        return observation, float(reward), bool(done), dict(info or {})

    def _encode_observation(self, text: str, sample: Sample) -> list[int]:
        # Leave room for at least one model token after it.
        limit = max(0, min(self.cfg.max_observation_tokens, self._room(sample)[0] - 1))
        return encode_observation(text, limit, self._ids, self.tokenizer_lock)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _end_reason(info: dict[str, Any]) -> str:
    reason = info.get("end_reason")
    return str(reason) if reason else "done"
