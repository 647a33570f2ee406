"""The learner actor: claims complete groups from the buffer, runs one PPO/GAE or GRPO update,
publishes the new weights. The math lives in slime/algorithms; this file moves tensors."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel

from slime.algorithms import grpo, ppo
from slime.algorithms.core import behaviour_is_weights, entropy_from_logits, masked_mean, masked_whiten
from slime.algorithms.kl import kl_penalty
from slime.algorithms.schedules import AdaptiveClip, staged_kl_coef
from slime.buffer import RedisBuffer
from slime.config import JobConfig
from slime.model import load_model
from slime.sample import Sample, Status
from slime.security import JobCredentials
from slime.weights import WeightHandle, make_transport


@dataclass
class Batch:
    """Right-padded prompt+response rows; response-aligned tensors are [N, T]."""

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    response_pos: torch.Tensor  # [N, T] index into the logits that predict response token t
    response_ids: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T] float: trainable tokens (loss mask, not padding, not failed)
    behaviour_logp: torch.Tensor  # [N, T] engine logprobs
    versions: torch.Tensor  # [N, T]
    scores: torch.Tensor  # [N]
    token_rewards: torch.Tensor | None  # [N, T]
    group_index: torch.Tensor  # [N]
    truncated: torch.Tensor  # [N] bool
    last_pos: torch.Tensor  # [N] position of the last response token: V there is V(s_end)
    response_len: torch.Tensor  # [N]
    # [N] bool: rows with token_rewards. PPO/GAE uses those alone for such a row (its scalar
    # reward, e.g. a PRM's aggregate, is for GRPO and the metrics), so nothing is counted twice.
    token_reward_rows: torch.Tensor | None = None

    def rows(self, idx: torch.Tensor) -> "Batch":
        """The rows `idx`, cut to their own widths (no compute on other rows' padding)."""
        width = int(self.last_pos[idx].max()) + 1
        t_len = max(1, int(self.response_len[idx].max()))

        def pick(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t[idx]
            if name in ("input_ids", "attention_mask"):
                return t[:, :width]
            return t[:, :t_len] if t.dim() == 2 else t

        sub = Batch(**{k: pick(k, v) for k, v in self.__dict__.items()})
        sub.response_pos = sub.response_pos.clamp(max=width - 1)
        return sub


def collate(samples: list[Sample], group_ids: list[int], pad_id: int) -> Batch:
    n = len(samples)
    width = max(len(s.prompt_ids) + s.response_length for s in samples)
    t_max = max(1, max(s.response_length for s in samples))
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    response_pos = torch.zeros((n, t_max), dtype=torch.long)
    response_ids = torch.zeros((n, t_max), dtype=torch.long)
    mask = torch.zeros((n, t_max))
    behaviour = torch.zeros((n, t_max))
    versions = torch.zeros((n, t_max), dtype=torch.long)
    scores = torch.zeros(n)
    token_rewards = None
    token_reward_rows = torch.zeros(n, dtype=torch.bool)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), s.response_length
        input_ids[i, :p] = torch.from_numpy(s.prompt_ids.astype(np.int64))
        input_ids[i, p : p + r] = torch.from_numpy(s.response_ids.astype(np.int64))
        attention[i, : p + r] = 1
        # Logits at position j predict token j+1; padding rows point at a valid position, masked out.
        response_pos[i] = torch.clamp(torch.arange(t_max) + p - 1, max=width - 1)
        response_ids[i, :r] = input_ids[i, p : p + r]
        if s.status != Status.FAILED:
            mask[i, :r] = torch.from_numpy(s.loss_mask.astype(np.float32))
        behaviour[i, :r] = torch.from_numpy(s.logprobs)
        versions[i, :r] = torch.from_numpy(s.versions.astype(np.int64))
        scores[i] = float(s.reward) if s.reward is not None else 0.0
        if s.token_rewards is not None:
            if token_rewards is None:
                token_rewards = torch.zeros((n, t_max))
            token_rewards[i, :r] = torch.from_numpy(s.token_rewards.astype(np.float32))
            token_reward_rows[i] = True
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        response_pos=response_pos,
        response_ids=response_ids,
        mask=mask,
        behaviour_logp=behaviour,
        versions=versions,
        scores=scores,
        token_rewards=token_rewards,
        group_index=torch.tensor(group_ids),
        truncated=torch.tensor([s.status == Status.TRUNCATED for s in samples]),
        last_pos=torch.tensor([len(s.prompt_ids) + s.response_length - 1 for s in samples]),
        response_len=torch.tensor([s.response_length for s in samples]),
        token_reward_rows=token_reward_rows if token_rewards is not None else None,
    )


def response_logprobs(
    model: torch.nn.Module, batch: Batch, temperature: float, with_entropy: bool = False, with_aux: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log π(a_t|s_t) of each response token under `temperature` (as the engine samples), [N, T]."""
    kwargs = {"output_router_logits": True} if with_aux else {}
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **kwargs)
    vocab = out.logits.shape[-1]
    logits = out.logits.gather(1, batch.response_pos[..., None].expand(-1, -1, vocab)) / temperature
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    entropy = entropy_from_logits(logits.float()) if with_entropy else None
    aux = getattr(out, "aux_loss", None) if with_aux else None
    return logp, entropy, aux


class ValueModel(torch.nn.Module):
    """Critic: the policy's backbone with a scalar head; V(s_t) read at the same positions as π."""

    def __init__(self, model_dir: str, dtype: torch.dtype):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(model_dir, dtype=dtype)
        hidden = self.backbone.config.hidden_size
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: Batch, with_last: bool = False):
        """V(s_t) for every response token [N, T]; with_last also V(s_end) after the last token [N]."""
        hidden = self.backbone(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
        ).last_hidden_state
        h = hidden.gather(1, batch.response_pos[..., None].expand(-1, -1, hidden.shape[-1]))
        values = self.head(h).squeeze(-1).float()
        if not with_last:
            return values
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), batch.last_pos]
        return values, self.head(last).squeeze(-1).float()


def _reward_stats(samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Per task (route): reward mean/std, failures and the reward call's latency p50/p99."""
    out: dict[str, dict[str, float]] = {}
    by_task: dict[str, list[Sample]] = {}
    for s in samples:
        by_task.setdefault(str(s.metadata.get("task", "default")), []).append(s)
    for task, group in by_task.items():
        rewards = [float(s.reward) for s in group if s.reward is not None and s.status != Status.FAILED]
        latency = [float(s.metadata["reward_latency_s"]) for s in group if "reward_latency_s" in s.metadata]
        out[task] = {
            "mean": float(np.mean(rewards)) if rewards else float("nan"),
            "std": float(np.std(rewards)) if rewards else float("nan"),
            "failures": float(sum(s.status == Status.FAILED for s in group)),
            "latency_p50_s": float(np.percentile(latency, 50)) if latency else float("nan"),
            "latency_p99_s": float(np.percentile(latency, 99)) if latency else float("nan"),
        }
    return out


def _histogram(values: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in sorted(values):
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def _micro_batches(batch: Batch, idx: torch.Tensor, size: int) -> list[torch.Tensor]:
    """`idx` in micro-batches of similar lengths: long-tail batches would otherwise pad every row
    to the longest response. Accumulation weights make the order irrelevant to the gradient."""
    order = idx[torch.argsort(batch.last_pos[idx], stable=True)]
    return list(order.split(size))


def _per_row(batch: Batch, size: int, fn) -> torch.Tensor:
    """fn(micro-batch) -> [rows, T'] for every row, assembled into [N, T] (zeros beyond T')."""
    n, t = batch.mask.shape
    out = torch.zeros((n, t), device=batch.mask.device)
    for idx in _micro_batches(batch, torch.arange(n, device=batch.mask.device), size):
        values = fn(batch.rows(idx))
        out[idx, : values.shape[1]] = values
    return out


class Learner:
    def __init__(self, cfg: JobConfig, model_dir: str, redis_url: str, credentials: JobCredentials | None = None):
        torch.set_num_threads(cfg.cluster.torch_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.algo = cfg.algorithm
        self.device = torch.device(cfg.learner.device)
        self.policy = load_model(model_dir, cfg.model.dtype, cfg.learner.device)
        self.policy.train()
        self.is_moe = hasattr(self.policy.config, "num_experts") or hasattr(self.policy.config, "num_local_experts")
        self.pad_id = self.policy.config.pad_token_id or 0
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        needs_ref = self.algo.kl_coef > 0 or any(s.coef > 0 for s in self.algo.kl_schedule)
        self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False) if needs_ref else None
        lc = cfg.learner
        self.optim = torch.optim.AdamW(self.policy.parameters(), lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
        self.critic = None
        if self.algo.name == "ppo":
            self.critic = ValueModel(model_dir, self.policy.dtype).to(self.device).train()
            self.critic_optim = torch.optim.AdamW(self.critic.parameters(), lr=lc.critic_lr, betas=lc.betas)
        self.clip = AdaptiveClip(self.algo.adaptive_clip, self.algo.clip_low, self.algo.clip_high)
        self.buffer = RedisBuffer(redis_url, cfg.job_name, cfg.buffer.lease_seconds,
                                  password=credentials.redis_password if credentials else None)
        self.version = self.buffer.get_policy_version()
        kind = cfg.weights.transport
        if kind == "auto":
            kind = "cuda_ipc" if self.device.type == "cuda" else "shm"
        self.transport = make_transport(
            kind, prefix=f"slime_{cfg.job_name}", directory=cfg.run_dir / "weights", bucket_mb=cfg.weights.bucket_mb,
            num_receivers=cfg.rollout.num_workers,  # broadcast: every engine joins each collective
        )

    # ---- one training step -------------------------------------------------------------------
    def train_step(self, step: int, num_groups: int, max_staleness: int | None = None, commit: bool = True) -> dict:
        """Claim up to num_groups complete groups and run one update. With commit=False the groups stay
        claimed until the caller commits the step (the driver does at each checkpoint, so a crash
        before the checkpoint requeues them for the restored weights: each group trains exactly once)."""
        started = time.time()
        groups = self.buffer.claim_groups(num_groups, step)
        kept, dropped_stale, wasted_tokens = [], 0, 0
        for g in groups:
            versions = [s.min_version for s in g if s.min_version is not None]
            if max_staleness is not None and versions and self.version - min(versions) > max_staleness:
                dropped_stale += 1
                wasted_tokens += sum(s.response_length for s in g)
            else:
                kept.append(g)
        if dropped_stale:
            self.buffer.incr_stat("dropped_groups:stale", dropped_stale)
            self.buffer.incr_stat("dropped_tokens:stale", wasted_tokens)
        metrics: dict = {"step": step, "groups": len(kept), "dropped_stale_groups": dropped_stale,
                         "dropped_stale_tokens": wasted_tokens}
        samples = [s for g in kept for s in g]
        if samples:
            metrics.update(self._update(samples, [gi for gi, g in enumerate(kept) for _ in g], step))
        self.version += 1
        self.buffer.set_policy_version(self.version)
        if commit:
            self.buffer.commit_step(step)
        metrics["policy_version"] = self.version
        metrics["learner_seconds"] = time.time() - started
        return metrics

    def _update(self, samples: list[Sample], group_ids: list[int], step: int, unfinished: list[bool] | None = None) -> dict:
        """One update. `unfinished` (streaming): rows whose trajectory goes on; their return is
        bootstrapped with the critic's V(s_end) instead of a terminal reward (truncated GAE)."""
        algo, lc = self.algo, self.cfg.learner
        batch = collate(samples, group_ids, self.pad_id)
        batch = Batch(**{k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.__dict__.items()})
        kl_coef = staged_kl_coef(step, algo.kl_schedule, algo.kl_coef)
        off_policy = self.cfg.april.off_policy
        stale = (batch.versions < self.version) & (batch.mask > 0)
        if off_policy == "mask_stale":
            batch.mask = batch.mask * (~stale).float()
        n = batch.input_ids.shape[0]
        valid = batch.mask.sum(-1) > 0
        mb = lc.micro_batch_size

        # Quantities fixed for the whole update: π_ref, V_old, π_old (when recomputed).
        with torch.no_grad():
            ref_logp = old_values = old_logp = None
            if self.ref is not None and kl_coef > 0:
                ref_logp = _per_row(batch, mb, lambda sub: response_logprobs(self.ref, sub, self.temperature)[0])
            bootstrap = None
            if self.critic is not None:
                old_values = _per_row(batch, mb, self.critic)
                if unfinished is not None:
                    last_values = torch.zeros(n, device=self.device)
                    for idx in _micro_batches(batch, torch.arange(n, device=self.device), mb):
                        last_values[idx] = self.critic(batch.rows(idx), with_last=True)[1]
                    bootstrap = torch.where(torch.tensor(unfinished, device=self.device), last_values, 0.0)
            multiple_updates = lc.ppo_epochs * lc.num_minibatches > 1
            if lc.recompute_old_logprobs or multiple_updates:
                old_logp = _per_row(batch, mb, lambda sub: response_logprobs(self.policy, sub, self.temperature)[0])

            if algo.name == "grpo":
                adv_seq = torch.zeros(n, device=self.device)
                if valid.any():
                    adv_seq[valid] = grpo.group_advantages(
                        batch.scores[valid], batch.group_index[valid], std_normalize=algo.grpo_std_normalize
                    )
                advantages = grpo.broadcast_to_tokens(adv_seq, batch.mask)
                returns = None
            else:
                kl_reward = None
                if algo.kl_mode == "reward" and ref_logp is not None:
                    kl_reward = kl_penalty(batch.behaviour_logp, ref_logp, algo.kl_estimator)
                outcome = batch.scores
                if batch.token_reward_rows is not None:
                    outcome = batch.scores.masked_fill(batch.token_reward_rows, 0.0)
                rewards = ppo.token_level_rewards(outcome, batch.mask, kl_reward, kl_coef, batch.token_rewards)
                advantages, returns = ppo.gae(rewards, old_values, batch.mask, algo.gamma, algo.lam, bootstrap)
                if algo.normalize_advantages:
                    advantages = masked_whiten(advantages, batch.mask) * batch.mask

        stats: dict[str, list[float]] = {}
        grad_norms, critic_grad_norms = [], []
        clip_low, clip_high = self.clip.clip_low, self.clip.clip_high
        for _epoch in range(lc.ppo_epochs):
            order = torch.randperm(n, device=self.device)
            for mini in order.chunk(lc.num_minibatches):
                self.optim.zero_grad(set_to_none=True)
                if self.critic is not None:
                    self.critic_optim.zero_grad(set_to_none=True)
                mini_tokens = batch.mask[mini].sum().clamp_min(1)
                mini_seqs = (batch.mask[mini].sum(-1) > 0).sum().clamp_min(1)
                for part in _micro_batches(batch, mini, mb):
                    sub = batch.rows(part)
                    t_sub = sub.mask.shape[1]
                    # Each micro-batch's aggregate is weighted by its share of the minibatch's
                    # tokens (token_mean) or sequences, so accumulation equals one big batch.
                    if algo.loss_agg == "token_mean":
                        weight = sub.mask.sum() / mini_tokens
                    else:
                        weight = (sub.mask.sum(-1) > 0).sum() / mini_seqs
                    if weight == 0:
                        continue
                    logp, entropy, aux = response_logprobs(
                        self.policy, sub, self.temperature, with_entropy=True, with_aux=self.is_moe and algo.router_aux_coef > 0
                    )
                    old = old_logp[part, :t_sub] if old_logp is not None else logp.detach()
                    # Engine vs learner logprobs of the same tokens: ~0 on-policy; large means the
                    # engine and learner disagree (stale weights, numerics, or a bug).
                    st_extra = {"behaviour_logp_abs_diff": masked_mean((logp.detach() - sub.behaviour_logp).abs(), sub.mask).item()}
                    # Truncated IS (tis): tokens sampled by an older policy, weighted by pi_old / pi_behaviour.
                    is_weights = behaviour_is_weights(old, sub.behaviour_logp, off_policy, self.cfg.april.tis_cap)
                    kl_loss = None
                    if ref_logp is not None and algo.kl_mode == "loss":
                        kl_loss = kl_penalty(logp, ref_logp[part, :t_sub], algo.kl_estimator)
                    common = dict(
                        logp=logp, old_logp=old, advantages=advantages[part, :t_sub], mask=sub.mask, clip_low=clip_low,
                        clip_high=clip_high, dual_clip=algo.dual_clip, agg_mode=algo.loss_agg, entropy=entropy,
                        entropy_coef=algo.entropy_coef, kl=kl_loss, kl_coef=kl_coef, router_aux=aux,
                        router_aux_coef=algo.router_aux_coef, is_weights=is_weights,
                    )
                    if self.critic is not None:
                        loss, st = ppo.ppo_loss(
                            **common, values=self.critic(sub), old_values=old_values[part, :t_sub],
                            returns=returns[part, :t_sub],
                            value_clip=algo.value_clip, vf_coef=algo.vf_coef,
                        )
                    else:
                        loss, st = grpo.grpo_loss(**common)
                    (loss * weight).backward()
                    st.update(st_extra)
                    for k, v in st.items():
                        stats.setdefault(k, []).append(v)
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), lc.grad_clip)))
                self.optim.step()
                if self.critic is not None:
                    critic_grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.critic.parameters(), lc.grad_clip)))
                    self.critic_optim.step()

        out = {k: float(np.mean(v)) for k, v in stats.items()}
        if algo.adaptive_clip.enabled and "approx_kl" in out:
            self.clip.update(out["approx_kl"])
        with torch.no_grad():
            tokens = batch.mask.sum()
            off_policy_tokens = stale.float().sum()
            if algo.name == "ppo":
                out["advantage_mean"] = masked_mean(advantages, batch.mask).item()
                out["return_mean"] = masked_mean(returns, batch.mask).item()
        lengths = np.array([s.response_length for s in samples])
        ok = [s for s in samples if s.status != Status.FAILED and s.reward is not None]
        by_task: dict[str, list[float]] = {}
        for s in ok:
            by_task.setdefault(str(s.metadata.get("task", "default")), []).append(float(s.reward))
        out.update(
            reward_mean=float(np.mean([s.reward for s in ok])) if ok else float("nan"),
            reward_std=float(np.std([s.reward for s in ok])) if ok else float("nan"),
            reward_by_task={k: float(np.mean(v)) for k, v in by_task.items()},
            samples=len(samples),
            failed_samples=len(samples) - len(ok),
            truncated_share=float(batch.truncated.float().mean()),
            response_len_mean=float(lengths.mean()),
            response_len_p50=float(np.percentile(lengths, 50)),
            response_len_p99=float(np.percentile(lengths, 99)),
            trained_tokens=int(tokens.item()),
            # Share of the batch's generated tokens that an older policy produced (before any masking).
            off_policy_token_share=float(off_policy_tokens / max(1, sum(s.response_length for s in samples))),
            version_lag_hist=_histogram([self.version - s.min_version for s in samples if s.min_version is not None]),
            version_span_hist=_histogram([s.version_span for s in samples]),
            resumed_samples=sum(1 for s in samples if s.version_span > 0),
            grad_norm=float(np.mean(grad_norms)),
            kl_coef=kl_coef,
            clip_low=clip_low,
            clip_high=clip_high,
            lr=self.optim.param_groups[0]["lr"],
        )
        if critic_grad_norms:
            out["critic_grad_norm"] = float(np.mean(critic_grad_norms))
        out["reward_stats"] = _reward_stats(samples)
        return out

    def train_segments(self, step: int, max_segments: int, chunk_tokens: int) -> dict:
        """Streaming variant: train on every trajectory's new tokens (>= chunk_tokens of them, or its
        end) before the trajectory finishes. Earlier tokens are context only (loss mask 0)."""
        started = time.time()
        claimed = self.buffer.claim_segments(chunk_tokens, max_segments)
        samples, unfinished = [], []
        for sample, start, final in claimed:
            sample.loss_mask = sample.loss_mask.copy()
            sample.loss_mask[:start] = 0
            if not final:
                sample.reward = None  # the return comes from the critic's bootstrap
            samples.append(sample)
            unfinished.append(not final)
        metrics: dict = {"step": step, "segments": len(samples), "final_segments": unfinished.count(False)}
        if samples:
            metrics.update(self._update(samples, list(range(len(samples))), step, unfinished))
        self.version += 1
        self.buffer.set_policy_version(self.version)
        metrics["policy_version"] = self.version
        metrics["learner_seconds"] = time.time() - started
        return metrics

    # ---- weights -----------------------------------------------------------------------------
    def publish_weights(self) -> WeightHandle:
        return self.transport.publish(self.version, self.policy.named_parameters())

    @torch.no_grad()
    def probe_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> np.ndarray:
        """Logprobs of a fixed probe response, to check an engine holds exactly these weights."""
        s = Sample(group_id="probe", index=0, prompt_ids=prompt_ids, max_new_tokens=len(response_ids))
        s.append(response_ids, np.zeros(len(response_ids)), self.version)
        batch = collate([s], [0], self.pad_id)
        batch = Batch(**{k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.__dict__.items()})
        self.policy.eval()
        logp = response_logprobs(self.policy, batch, self.temperature)[0][0]
        self.policy.train()
        return logp.cpu().numpy()

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, directory: str) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(path / "policy")
        state = {"optim": self.optim.state_dict(), "clip": self.clip.state_dict(), "version": self.version}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optim"] = self.critic_optim.state_dict()
        torch.save(state, path / "learner_state.pt")
        (path / "learner.json").write_text(json.dumps({"version": self.version}))

    def load(self, directory: str) -> int:
        path = Path(directory)
        # from_pretrained, not the raw files: transformers converts its on-disk layout (e.g.
        # per-expert MoE weights) back to the in-memory one.
        saved = load_model(path / "policy", self.cfg.model.dtype, "cpu")
        self.policy.load_state_dict(saved.state_dict())
        del saved
        # weights_only: tensors and plain containers only; a crafted checkpoint cannot run code.
        state = torch.load(path / "learner_state.pt", weights_only=True)
        self.optim.load_state_dict(state["optim"])
        self.clip.load_state_dict(state["clip"])
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(state["critic"])
            self.critic_optim.load_state_dict(state["critic_optim"])
        self.version = int(state["version"])
        self.buffer.set_policy_version(self.version)
        return self.version

    def close(self) -> None:
        self.transport.close()
