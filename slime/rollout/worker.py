"""Rollout workers: one engine each, pulling trajectories from the buffer and writing chunks back.

The generation loop runs on a thread inside the actor; the actor's methods (weight update,
abort, pause) take the engine lock, so they act between two decode steps. Rewards run on the
worker's RewardRunner threads and never block decoding; the generation thread writes the scored
samples' final status to the buffer between two steps, all of them in one batch. A step's chunk
writes are sent right after it and their replies read after the next step, so Redis executes
them while the engine computes.

Longer than 500 lines: one generation loop whose phases (admit, absorb chunks, settle rewards,
finish episodes, abort) share the pending samples and the engine lock; rewards, multi-turn episodes
and chunking helpers are files of their own.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
from concurrent.futures import Future

import numpy as np
import torch

from april.scheduler import StalenessBudget
from rewards.plugin import load_function
from rewards.prm import place_step_rewards, step_end_tokens_of_ids
from rewards.runner import RewardResult, StepScores
from rewards.service import make_reward_service, wants_model_text
from slime.buffer import (
    ChunksLostError,
    Finish,
    JobConnection,
    JobTelemetry,
    LeaseLostError,
    PendingReplies,
    TrajectoryStore,
)
from slime.config import JobConfig
from slime.data import sample_reward_inputs
from slime.engines import make_engine, run_to_completion
from slime.engines.contract import GenerationChunk, GenerationRequest, SamplingParams, check_temperature
from slime.engines.expert_load import ExpertLoadRecorder
from slime.errors import dump_stacks_on_sigusr1
from slime.model import load_tokenizer, rollout_sampling_params
from slime.rollout.multiturn import EpisodeEnd, MultiTurnRollout
from slime.sample import Sample, Status
from slime.security import JobCredentials
from slime.weights import WeightHandle, make_transport


class _Pending:
    """Tokens produced by the engine and not yet written to the buffer, for one trajectory."""

    __slots__ = ("sample", "tokens", "logprobs", "versions", "routing", "sent")

    def __init__(self, sample: Sample):
        self.sample = sample
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.routing: list[bytes] = []  # routing replay: each token's recorded experts
        self.sent = sample.response_length  # response tokens stored or on their way to the buffer

    def chunk_due(self, chunk_tokens: int) -> bool:
        """Chunks end at multiples of chunk_tokens of the whole response, so a resumed partial's
        chunks (and the chunk sampler's decisions) fall where they would have without the abort."""
        return len(self.tokens) >= chunk_tokens - self.sent % chunk_tokens


class _SentChunks:
    """Chunk writes sent to the buffer whose replies are not read yet; the trajectories that
    finished with them wait for those replies."""

    __slots__ = ("sent", "finished", "replies")

    def __init__(
        self,
        sent: list[tuple[_Pending, list[int], list[float], list[int]]],
        finished: list[tuple[_Pending, str | None]],
        replies: PendingReplies,
    ):
        self.sent, self.finished, self.replies = sent, finished, replies


class RolloutWorker:
    def __init__(
        self,
        cfg: JobConfig,
        model_dir: str,
        redis_url: str,
        worker_id: str,
        index: int = 0,
        credentials: JobCredentials | None = None,
        paused: bool = False,
    ):
        """``paused``: lease nothing until ``resume`` (a worker joining a running job gets the
        current weights first; slime/fleet.py)."""
        torch.set_num_threads(cfg.cluster.torch_threads)
        dump_stacks_on_sigusr1()  # on Ray this is the actor's own process
        self.cfg = cfg
        self.worker_id = worker_id
        self.tokenizer = load_tokenizer(model_dir)
        connection = JobConnection.of_job(cfg, redis_url, credentials.redis_password if credentials else None)
        self.buffer = TrajectoryStore(connection, cfg.buffer.lease_seconds)
        self.telemetry = JobTelemetry(connection)  # expert load; one Redis connection per process
        self.engine = make_engine(
            cfg,
            model_dir,
            index,
            self.buffer.get_policy_version(),
            api_token=credentials.token("sglang") if credentials else None,
        )
        model = getattr(self.engine, "model", None)  # the built-in engine's torch model: per-expert load
        self.expert_load = ExpertLoadRecorder.attach(model if isinstance(model, torch.nn.Module) else None)
        self.params = rollout_sampling_params(cfg.rollout, self.tokenizer)
        # reward.scope=group: the learner scores each group as it takes it; the workers score nothing.
        self.rewards = make_reward_service(cfg.reward, cfg.job_name) if cfg.reward.scope == "sample" else None
        self.model_text = self.rewards is not None and wants_model_text(cfg.reward)  # a decode more per response
        self.staleness_budget = StalenessBudget(cfg.april.max_version_span, cfg.april.beyond_budget)
        self.chunk_sampler = load_function(cfg.april.chunk_sampler) if cfg.april.chunk_sampler else None
        # Set by a reward or an env call as it completes: an idle loop wakes for it at once, rather
        # than after its 10 ms wait (the last group's reward held every sync step's end by up to that).
        self.wake = threading.Event()
        # Multi-turn episodes (env.plugin set): slime/rollout/multiturn.py owns the turn state machine.
        self.multiturn = (
            MultiTurnRollout(
                cfg.env,
                self.tokenizer,
                self.params,
                self.buffer,
                worker_id,
                getattr(self.engine, "max_seq_len", None),
                on_env_done=self.wake.set,
            )
            if cfg.env.plugin
            else None
        )
        self.transport = make_transport(
            cfg.weight_transport,
            prefix=f"slime_{cfg.job_name}",
            directory=cfg.run_dir / "weights",
            bucket_mb=cfg.weights.bucket_mb,
        )
        self.lock = threading.Lock()
        self.pending: dict[str, _Pending] = {}
        self.unsettled: _SentChunks | None = None  # the last step's chunk writes, replies unread
        self.unsettled_finishes: tuple[list[tuple[Sample, Status, RewardResult]], PendingReplies] | None = None
        self.scoring: dict[str, Future] = {}
        # Scored, not finished in the buffer yet. Reward callbacks only append here (deque appends are
        # thread-safe); the generation thread finishes them in one batch between two engine steps.
        # Finishing them on threads of their own slowed every engine step by ~30% on CPU: each
        # thread's Python work contends for the GIL with the many short torch ops of a step.
        self.scored: collections.deque[tuple[Sample, Status, RewardResult]] = collections.deque()
        self.paused = threading.Event()
        self.stopped = threading.Event()
        self.error: str | None = None
        self.generated_tokens = 0
        self.last_empty_lease = 0.0
        self.busy_seconds = 0.0
        # Time the generation thread spends outside engine steps on buffer I/O (leases, chunk
        # writes, finishing): the bookkeeping that keeps the engine from being busy all the time.
        self.admit_seconds = 0.0
        self.absorb_seconds = 0.0
        self.started_at = time.time()
        if paused:
            self.paused.set()
        self.thread = threading.Thread(target=self._run, name=f"rollout-{worker_id}", daemon=True)
        self.thread.start()

    # ---- the generation loop -----------------------------------------------------------------
    def _run(self) -> None:
        last_renew = time.time()
        try:
            while not self.stopped.is_set():
                if self.paused.is_set():
                    if self.scored or self.unsettled is not None or self.unsettled_finishes is not None:
                        with self.lock:
                            self._settle()
                            self._finish_scored()
                    if self.scoring and time.time() - last_renew > self.cfg.buffer.lease_seconds / 3:
                        # rewards still running (a retiring worker waits for them): keep their leases
                        self.buffer.renew_leases(self.worker_id, list(self.scoring))
                        last_renew = time.time()
                    time.sleep(0.005)
                    continue
                with self.lock:
                    t0 = time.time()
                    self.wake.clear()  # before the look at what completed: a later completion sets it again
                    self._finish_scored()
                    self._admit()
                    if self.multiturn is not None:
                        self._advance_episodes()
                    t1 = time.time()
                    self.admit_seconds += t1 - t0
                    if not self.engine.has_unfinished():
                        idle = True
                        self._settle()
                    else:
                        idle = False
                        chunks = self.engine.step()
                        t2 = time.time()
                        self.busy_seconds += t2 - t1
                        self._absorb(chunks)
                        self.absorb_seconds += time.time() - t2
                if time.time() - last_renew > self.cfg.buffer.lease_seconds / 3:
                    env_turns = self.multiturn.env_turn_ids() if self.multiturn is not None else []
                    self.buffer.renew_leases(self.worker_id, list(self.pending) + list(self.scoring) + env_turns)
                    self.buffer.reap_expired_leases()
                    if self.expert_load is not None:
                        self.telemetry.add_expert_load(self.expert_load.take())
                    last_renew = time.time()
                if idle:
                    if self.scoring or self.multiturn is not None:
                        self.wake.wait(0.01)
                    else:  # only new groups can give it work: woken the moment the driver adds them
                        self.buffer.wait_for_work_signal(0.01)
        except Exception:  # surfaced through health(); the driver stops the job with it
            self.error = traceback.format_exc()

    def _admit(self) -> None:
        free = self.cfg.rollout.max_running_requests - self.engine.num_running() - self.engine.num_waiting()
        if self.multiturn is not None:
            free -= len(self.multiturn.env_turn_ids())
        # While the engine decodes, an empty queue is asked again only every 20 ms, not on every
        # decode step. An idle engine asks on every turn of the loop (every 10 ms at most): with the
        # 20 ms wait there too, a sync step's groups waited ~20 ms for their first lease, since the
        # idle worker had just found the queue empty while the driver ended the previous step.
        busy = self.engine.has_unfinished()
        if free <= 0 or (busy and time.time() - self.last_empty_lease < 0.02):
            return
        leased = self.buffer.lease(self.worker_id, free)
        if not leased:
            self.last_empty_lease = time.time()
        for sample in leased:
            if not self._within_staleness_budget(sample):
                continue
            if self.multiturn is not None:
                self.multiturn.begin(sample)  # env reset (and replay, on resume) off this thread
                continue
            if sample.remaining_tokens == 0:  # aborted exactly at its budget: nothing left to generate
                self._finalize(_Pending(sample), "length")
                continue
            self.pending[sample.id] = _Pending(sample)
            params = SamplingParams(**{**self.params.__dict__, "max_new_tokens": sample.max_new_tokens})
            if self.chunk_sampler is not None and sample.response_length and params.temperature > 0:
                # A resumed partial: the hook's temperature, not the base one, for what it goes on with.
                temperature = self._chunk_temperature(sample)
                if temperature is not None:
                    params = SamplingParams(**{**params.__dict__, "temperature": temperature})
            self.engine.add_request(
                GenerationRequest(sample.id, sample.prompt_ids.tolist(), params, sample.response_ids.tolist())
            )

    def _within_staleness_budget(self, sample: Sample) -> bool:
        """APRIL's staleness budget for a resumed partial: continue it, restart it, or fail it."""
        verdict = self.staleness_budget.verdict(sample.min_version, self.engine.version)
        if verdict == "resume":
            return True
        lag, budget = self.engine.version - sample.min_version, self.staleness_budget.max_version_span
        if verdict == "restart":
            self.buffer.restart_sample(sample.id, self.worker_id)
            sample.response_ids, sample.logprobs = sample.response_ids[:0], sample.logprobs[:0]
            sample.versions, sample.loss_mask = sample.versions[:0], sample.loss_mask[:0]
            return True
        self.buffer.finish(
            sample.id,
            self.worker_id,
            Status.FAILED,
            failure=f"stale partial: oldest token is {lag} policy versions old (april.max_version_span={budget})",
        )
        return False

    def _absorb(self, chunks: list[GenerationChunk], wait: bool = False) -> None:
        """Take a step's chunks: send the due chunk writes now and read their replies at the next
        call (after the next engine step, which runs while Redis executes them); with ``wait``,
        read them now. Finished trajectories are finalized (or released, if aborted) once their
        last chunk is confirmed stored."""
        self._settle()
        to_flush: list[_Pending] = []
        finished: list[tuple[_Pending, str | None]] = []
        for chunk in chunks:
            p = self.pending.get(chunk.request_id)
            if p is None:
                continue
            p.tokens.extend(chunk.token_ids)
            p.logprobs.extend(chunk.logprobs)
            p.versions.extend([chunk.version] * len(chunk.token_ids))
            if chunk.routing is not None:
                p.routing.extend(chunk.routing)
            self.generated_tokens += len(chunk.token_ids)
            if (chunk.finished or p.chunk_due(self.cfg.rollout.chunk_tokens)) and p.tokens:
                to_flush.append(p)
            if chunk.finished:
                finished.append((p, chunk.finish_reason))
        if to_flush or finished:
            sent = [(p, p.tokens, p.logprobs, p.versions) for p in to_flush]
            routing = [b"".join(p.routing) if p.routing else None for p in to_flush]
            for p in to_flush:
                p.sent += len(p.tokens)
                p.tokens, p.logprobs, p.versions, p.routing = [], [], [], []
            replies = self.buffer.send_append_chunks(
                self.worker_id,
                [(p.sample.id, t, lp, v, p.sample.response_length, r) for (p, t, lp, v), r in zip(sent, routing)],
            )
            self.unsettled = _SentChunks(sent, finished, replies)
            if self.chunk_sampler is not None:
                # Now, before the next engine step: that step samples the next chunk's first token.
                ended = {p.sample.id for p, _ in finished}
                for p, tokens, _, _ in sent:
                    if p.sample.id not in ended:
                        self._sample_next_chunk(p.sample, tokens)
        if wait:
            self._settle()

    def _settle(self) -> None:
        """Read the replies of the chunk writes sent last (see _absorb) and act on them. A lost
        lease means this worker was too slow: the sample went back to the queue with the tokens
        stored so far, another worker continues it, and we drop our copy (and the engine's)."""
        flush, self.unsettled = self.unsettled, None
        if flush is None:
            return
        lost: set[str] = set()
        gaps: list[str] = []
        for (p, tokens, logprobs, versions), result in zip(flush.sent, flush.replies.wait()):
            if isinstance(result, (LeaseLostError, ChunksLostError)):
                self.engine.abort([p.sample.id])
                self.engine.forget([p.sample.id])  # the new owner continues it: our kept cache is dead
                self.pending.pop(p.sample.id, None)
                if self.multiturn is not None:
                    self.multiturn.drop(p.sample.id)
                lost.add(p.sample.id)
                if isinstance(result, ChunksLostError):  # resumed, by any worker, from what is stored
                    gaps.append(p.sample.id)
                continue
            if isinstance(result, Exception):
                raise result
            p.sample.append(tokens, logprobs, np.array(versions))
        aborted: list[str] = []
        for p, reason in flush.finished:
            if p.sample.id in lost:
                continue
            del self.pending[p.sample.id]
            if self.multiturn is not None and self.multiturn.model_turn_ended(p.sample, reason):
                continue  # the env's turn now
            if reason == "abort":
                aborted.append(p.sample.id)
            else:
                self._finalize(p, reason)
        self._release(gaps + aborted)

    def _release(self, sample_ids: list[str]) -> None:
        """Aborted: back to the front of the resume queue, tokens kept, in one round trip."""
        for error in self.buffer.release_many(sample_ids, self.worker_id):
            if error is not None and not isinstance(error, LeaseLostError):  # lost: requeued meanwhile
                raise error

    def _sample_next_chunk(self, sample: Sample, new_tokens: list[int]) -> None:
        """The active sampler (GLM-5 report): after each chunk a user hook may pick the temperature
        of the next one from the trajectory's state. The stored behaviour logprobs follow it, and
        the learner's importance weights correct for the difference. Called when the chunk is sent
        (``new_tokens``, not confirmed stored yet), so the next chunk's first token already uses it."""
        temperature = self._chunk_temperature(sample, new_tokens)
        if temperature is not None:
            self.engine.set_temperature(sample.id, temperature)

    def _chunk_temperature(self, sample: Sample, new_tokens: list[int] | None = None) -> float | None:
        """The hook's temperature for what `sample` generates next (its stored tokens + `new_tokens`)."""
        ids = sample.response_ids.tolist() + list(new_tokens or [])
        state = {
            "response_length": len(ids),
            "response_tail": self.tokenizer.decode(ids[-32:], skip_special_tokens=True),
            "policy_version": self.engine.version,
            "metadata": sample.metadata,
        }
        temperature = self.chunk_sampler(state)
        if temperature is None:
            return None
        try:  # 1e-45 or NaN gave NaN probabilities: token 0, and a non-finite logprob
            return check_temperature(temperature)
        except ValueError as exc:
            raise ValueError(
                f"april.chunk_sampler {self.cfg.april.chunk_sampler} returned {temperature!r:.100}: {exc} "
                "(or None: the job's)"
            ) from None

    def _finalize(self, p: _Pending, finish_reason: str | None) -> None:
        sample = p.sample
        status = Status.TRUNCATED if finish_reason == "length" else Status.COMPLETED
        if self.rewards is None:  # reward.scope=group: the learner scores the whole group when it takes it
            self.scored.append((sample, status, RewardResult(None, None, 0.0)))
            return
        stop = set(self.params.stop_token_ids)
        inputs = sample_reward_inputs(sample, status, self.tokenizer, stop, self.model_text)
        future = self.rewards.submit(*inputs)
        self.scoring[sample.id] = future
        future.add_done_callback(lambda f, s=sample, st=status: self._scored(s, st, f.result()))

    def _scored(self, sample: Sample, status: Status, result: RewardResult) -> None:
        """A reward thread's callback: queue the sample to finish, wake an idle generation loop."""
        self.scored.append((sample, status, result))
        self.wake.set()

    def _advance_episodes(self) -> None:
        """Multi-turn: abort model turns past their time limit, start the turns whose env step finished
        (observation tokens already stored with loss mask 0), finish the episodes that ended."""
        overdue = self.multiturn.overdue()
        if overdue:
            self._absorb(self.engine.abort(overdue))
        for sample, next_step in self.multiturn.poll(self.engine.version):
            if isinstance(next_step, EpisodeEnd):
                self._finish_episode(sample, next_step)
            else:
                self.pending[sample.id] = _Pending(sample)
                self.engine.add_request(next_step)

    def _finish_episode(self, sample: Sample, end: EpisodeEnd) -> None:
        """env.reward=env: the episode's return is the reward; reward_fn: reward.fn scores the transcript."""
        self.engine.forget([sample.id])  # its last turn's kept cache: no turn comes after it
        sample.metadata.update(end.metadata())
        if end.status != Status.FAILED and self.cfg.env.reward == "reward_fn":
            self._finalize(_Pending(sample), "length" if end.status == Status.TRUNCATED else "stop")
            return
        per_turn = self.cfg.env.turn_rewards and end.status != Status.FAILED
        try:
            self.buffer.finish(
                sample.id,
                self.worker_id,
                end.status,
                failure=end.reason if end.status == Status.FAILED else None,
                reward=None if end.status == Status.FAILED else end.env_return,
                token_rewards=end.turn_rewards(sample.loss_mask[: sample.response_length]) if per_turn else None,
                metadata_update=end.metadata(),
            )
        except LeaseLostError:
            pass  # requeued meanwhile; the new owner resumes the episode

    def _finish_scored(self, wait: bool = False) -> None:
        """Write every scored sample's final status (reward, or the failure) in one batch; its
        replies are read at the next call (Redis executes it meanwhile), or now with ``wait``."""
        sent, self.unsettled_finishes = self.unsettled_finishes, None
        if sent is not None:
            batch, replies = sent
            gaps = []
            for (sample, _, _), result in zip(batch, replies.wait()):
                self.scoring.pop(sample.id, None)
                if isinstance(result, ChunksLostError):  # its tail was lost: resumed from what is stored
                    gaps.append(sample.id)
                # Lost: requeued meanwhile; the new owner regenerates nothing and rescores it.
                elif isinstance(result, Exception) and not isinstance(result, LeaseLostError):
                    raise result
            self._release(gaps)
        if self.scored:
            batch = [self.scored.popleft() for _ in range(len(self.scored))]
            self.unsettled_finishes = (
                batch,
                self.buffer.send_finish_many(self.worker_id, [self._finish_of(*item) for item in batch]),
            )
        if wait and self.unsettled_finishes is not None:
            self._finish_scored()

    def _leave_interrupted_unfinished(self) -> None:
        """A reward call the stop cut short is not the reward's failure: its sample stays RUNNING
        in the buffer, tokens kept, and the next run (its requeue of the leased samples) scores it
        again, instead of training it as failed."""
        interrupted = [item for item in self.scored if item[2].interrupted]
        if interrupted:
            self.scored = collections.deque(item for item in self.scored if not item[2].interrupted)
            for sample, _, _ in interrupted:
                self.scoring.pop(sample.id, None)

    def _finish_of(self, sample: Sample, status: Status, result: RewardResult) -> Finish:
        meta = {"reward_latency_s": result.latency_s}
        stored = sample.metadata  # as leased (with a multi-turn episode's env_ fields added since)
        if result.failure is not None:
            return Finish(
                sample.id,
                Status.FAILED,
                failure=result.failure,
                metadata_update=meta,
                stored_metadata=stored,
                stored_length=sample.response_length,
            )
        if result.info:
            meta["reward_info"] = result.info
        try:
            token_rewards = self._step_rewards_on_tokens(sample, result.steps)
        except Exception as exc:
            return Finish(
                sample.id,
                Status.FAILED,
                metadata_update=meta,
                stored_metadata=stored,
                failure=f"placing per-step rewards on tokens failed: {type(exc).__name__}: {exc}",
                stored_length=sample.response_length,
            )
        return Finish(
            sample.id,
            status,
            reward=result.reward,
            token_rewards=token_rewards,
            metadata_update=meta,
            stored_metadata=stored,
            stored_length=sample.response_length,
        )

    def _step_rewards_on_tokens(self, sample: Sample, steps: StepScores | None) -> np.ndarray | None:
        """Per-step rewards (a PRM's) on the token holding each step's last character of the
        scored text (rewards/prm.py), zero elsewhere: PPO/GAE's token-level rewards."""
        if steps is None:
            return None
        ids = sample.response_ids.tolist()
        if ids and ids[-1] in self.params.stop_token_ids:
            ids = ids[:-1]  # _finalize scored the text without it
        if not ids:
            return None
        ends = step_end_tokens_of_ids(self.tokenizer, ids, steps.ends)
        # A step that ends inside an observation (a multi-turn episode: mask-0 tokens) would have its
        # score dropped by GAE's mask: move it to the last trainable token before, else the first after.
        trainable = np.flatnonzero(np.asarray(sample.loss_mask)[: sample.response_length] > 0)
        if len(trainable):
            before = np.searchsorted(trainable, ends, side="right") - 1
            ends = [int(trainable[b]) if b >= 0 else int(trainable[0]) for b in before]
        return place_step_rewards(sample.response_length, ends, steps.scores)

    # ---- control (called by the driver) -------------------------------------------------------
    def set_max_version_span(self, max_version_span: int | None) -> None:
        """APRIL's staleness budget from now on (algorithm.correction.auto moves it between steps)."""
        self.staleness_budget = StalenessBudget(max_version_span, self.cfg.april.beyond_budget)

    def update_weights(self, handle: WeightHandle) -> float:
        t0 = time.time()
        with self.lock:
            self.engine.update_weights(handle.version, self.transport.receive(handle))
        return time.time() - t0

    def abort_all(self) -> int:
        """Pause, then abort every request in the engine: each partial (tokens, logprobs, versions)
        is written to the buffer and goes to the front of the resume queue. Returns how many."""
        self.paused.set()
        with self.lock:
            answered = self._store_answered_env_turns()
            chunks = self.engine.abort(None)
            self._absorb(chunks, wait=True)
            # Episodes whose env step is still running: their stored tokens end with a finished model
            # turn; the resumed episode redoes that env step.
            env_turns = self.multiturn.abort_env_turns() if self.multiturn is not None else []
            self._release(answered + env_turns)
            return len(chunks) + len(answered) + len(env_turns)

    def _store_answered_env_turns(self) -> list[str]:
        """Before an abort: env steps that already returned are stored (their observation, or the
        episode's end), so that no resumed episode steps its env twice for one turn. Returns the
        episodes to release, whose next model turn starts when they resume."""
        if self.multiturn is None:
            return []
        answered = []
        for sample, next_step in self.multiturn.poll(self.engine.version):
            if isinstance(next_step, EpisodeEnd):
                self._finish_episode(sample, next_step)
            else:
                self.multiturn.drop(sample.id)
                answered.append(sample.id)
        return answered

    def release_memory(self) -> int:
        """The engine frees its KV memory while the learner trains (rollout.release_memory); bytes freed."""
        with self.lock:
            return int(self.engine.release_memory())

    def resume_memory(self) -> None:
        """The engine takes its memory back (before the weight update and the next generation)."""
        with self.lock:
            self.engine.resume_memory()

    def pause(self) -> None:
        self.paused.set()

    def resume(self) -> None:
        self.paused.clear()

    def probe_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> np.ndarray:
        with self.lock:
            return np.asarray(self.engine.score_logprobs(prompt_ids, response_ids, self.params.temperature), np.float32)

    def weight_checksums(self) -> dict | None:
        with self.lock:
            return self.engine.weight_checksums()

    def generate_for_eval(self, requests: list[GenerationRequest]) -> dict[str, dict]:
        """Held-out prompts on the weights this engine holds (eval.every_steps): what it was
        generating is aborted first, as APRIL aborts (stored, tokens kept, resumed later); the eval
        requests run alone to the end; then the worker goes on as it was, paused or not."""
        was_paused = self.paused.is_set()
        self.abort_all()
        with self.lock:
            answers = run_to_completion(self.engine, requests)
        if not was_paused:
            self.paused.clear()
        return answers

    def health(self) -> dict:
        engine = self.engine.health()
        return {
            "worker_id": self.worker_id,
            "alive": self.thread.is_alive(),
            "error": self.error or engine.get("error"),  # engines that run servers report a dead one
            "version": self.engine.version,
            "running": self.engine.num_running(),
            "waiting": self.engine.num_waiting(),
            "scoring": len(self.scoring),
            "generated_tokens": self.generated_tokens,
            "engine_tokens_generated": engine["tokens_generated"],
            "decode_steps": engine.get("decode_steps", 0),
            "decode_rows": engine.get("decode_rows", 0),
            "forward": engine.get("forward"),  # the built-in engine's path: fast, generic or hf
            "kv_resumes": engine.get("kv_resumes", 0),  # partials and next turns rejoined from a kept KV cache
            "kv_resumed_tokens": engine.get("kv_resumed_tokens", 0),
            "busy_seconds": self.busy_seconds,
            "admit_seconds": self.admit_seconds,
            "absorb_seconds": self.absorb_seconds,
            "uptime_seconds": time.time() - self.started_at,
        }

    def retire(self) -> dict[str, int]:
        """Leave a running job (elastic rollout) losing nothing: every request aborted, its partial
        stored and requeued first, tokens kept (abort_all); the rewards still running finish and their
        samples are stored (the paused loop writes them), within the longest a reward may take; then
        stop. Returns the requests aborted and the tokens this worker generated in all."""
        aborted = self.abort_all()
        deadline = time.time() + self.cfg.reward.timeout_s + self.cfg.rollout.hang_timeout_s
        while (self.scoring or self.scored) and self.thread.is_alive() and time.time() < deadline:
            time.sleep(0.01)
        self.stop()
        return {"aborted": aborted, "generated_tokens": self.generated_tokens}

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=30)
        with self.lock:
            self._settle()  # the last chunk writes' replies; their finished samples go to scoring
        if self.expert_load is not None:  # the counts since the last periodic flush
            self.telemetry.add_expert_load(self.expert_load.take())
        if self.rewards is not None:
            self.rewards.close()  # calls still running resolve, as interrupted, into self.scored
        self._leave_interrupted_unfinished()
        self._finish_scored(wait=True)
        self.transport.close()
        self.engine.close()  # engines that run servers (SGLang) stop them
        if self.multiturn is not None:
            self.multiturn.close()
