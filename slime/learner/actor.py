"""The learner actor, one rank of the learner group: claims complete groups from the buffer, runs
one update of the configured algorithm, publishes the new weights. What turns a batch into a loss
lives in slime/algorithms (one file per algorithm); this file moves tensors: micro-batches,
gradient accumulation, the optimizers, gradient clipping, checkpoints and weight publishing.

With learner.num_ranks = N > 1 every rank holds the whole batch (rank 0 claims it; the group hands
it to all), computes the rows the token-balanced split gives it, and FSDP2 sums the gradients
into each rank's shard (sharding.py). Every micro-batch is weighted by its share of the global
minibatch, so N ranks take the optimizer step one rank would on the same batch.

Longer than 500 lines: one Ray actor's methods around one update (claim, prepare, micro-batches,
optimizer step, metrics, publish, checkpoint); the algorithms, packing, sharding and forwards are
files of their own.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from slime.algorithms import make_algorithm
from slime.algorithms.batch import Batch, Forward, UpdateTensors, collate
from slime.algorithms.core import masked_mean, off_policy_mask, stale_tokens
from slime.algorithms.corrections import CorrectionInputs, make_correction
from slime.algorithms.mismatch import MismatchMeter
from slime.algorithms.schedules import AdaptiveClip, AdaptiveKL, lr_factor, staged_kl_coef
from slime.buffer import JobConnection, TrajectoryStore
from slime.config import JobConfig
from slime.engines.routing import replay_misfit
from slime.errors import UserError, dump_stacks_on_sigusr1
from slime.learner import flops, lora, sharding
from slime.learner.forwards import ValueModel, checkpoint_activations, response_logprobs, use_logit_chunks
from slime.learner.group_rewards import GroupRewards
from slime.learner.packing import packing_misfit, use_packed_attention
from slime.model import disable_dropout, load_model, no_cudnn_attention, train_mode_gap
from slime.sample import Sample, Status, failure_key
from slime.security import JobCredentials
from slime.weights import WeightHandle, make_transport
from slime.weights.checksum import Checksum, checksums_as

log = logging.getLogger(__name__)


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


def _reward_info_means(samples: list[Sample]) -> dict[str, float]:
    """The mean of each number a reward reported beside its score (`reward_info`: verl's extra dict
    keys, TRL's log_metric/log_extra, OpenRLHF's extra_logs), over the samples that report it."""
    values: dict[str, list[float]] = {}
    for s in samples:
        info = s.metadata.get("reward_info")
        if not isinstance(info, dict):
            continue
        for key, value in info.items():
            if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
                values.setdefault(str(key), []).append(float(value))
    return {key: float(np.mean(v)) for key, v in sorted(values.items())}


def _failures_by_reason(samples: list[Sample]) -> dict[str, dict]:
    """Failed samples by reason (sample.failure_key): how many, and one example of each."""
    out: dict[str, dict] = {}
    for s in samples:
        if s.status != Status.FAILED:
            continue
        entry = out.setdefault(failure_key(s.failure), {"count": 0, "example_id": s.id, "example": s.failure})
        entry["count"] += 1
    return out


def _aggregate(name: str, values: list[float], tokens: list[float]) -> float:
    """A stat over the micro-batches: the maximum for ``*_max``, else the weighted mean."""
    if name.endswith("_max"):
        return float(np.max(values))
    return float(np.average(values, weights=tokens)) if sum(tokens) > 0 else float(np.mean(values))


def _histogram(values: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in sorted(values):
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def make_adamw(params: Iterable[torch.nn.Parameter], sharded: bool, **settings) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where it applies (plain CPU or CUDA float tensors): one
    kernel for all parameters instead of a dozen ops per tensor (1.85 ms against 5.5 ms a step on
    CPU for the tiny MoE's 67 tensors). FSDP2's sharded parameters keep torch's default."""
    params = list(params)
    fused = not sharded and all(
        p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params
    )
    return torch.optim.AdamW(params, **settings, **({"fused": True} if fused else {}))


def _step_if_finite(optim: torch.optim.Optimizer, grad_norm: float, which: str) -> None:
    """The optimizer step, unless the gradient holds a NaN or inf (one such step would make every
    weight NaN, and every later rollout garbage) or is exactly zero (a batch with nothing to learn,
    e.g. every group's rewards equal: AdamW would still move the weights by its momentum and weight
    decay; at lr 2e-3 that drift alone collapsed a policy). The norm is the global one, so all ranks
    agree."""
    if not math.isfinite(grad_norm):
        log.warning("learner: %s gradient norm is %s; this optimizer step is skipped", which, grad_norm)
    elif grad_norm > 0.0:
        optim.step()


def _micro_batches(
    batch: Batch, idx: torch.Tensor, size: int, max_tokens: int | None, packed: bool
) -> list[torch.Tensor]:
    """`idx` in micro-batches of similar lengths: long-tail batches would otherwise pad every row
    to the longest response. Accumulation weights make the order irrelevant to the gradient.
    max_tokens: cut by tokens instead of rows (the real tokens when packed, rows x the longest
    row when padded); a row longer than the budget goes alone."""
    order = idx[torch.argsort(batch.last_pos[idx], stable=True)]
    if max_tokens is None:
        return list(order.split(size))
    parts, start, tokens = [], 0, 0
    for i, length in enumerate((batch.last_pos[order] + 1).tolist()):
        # ascending lengths: this row is the longest so far
        cost = tokens + length if packed else (i - start + 1) * length
        if i > start and cost > max_tokens:
            parts.append(order[start:i])
            start, tokens = i, 0
        tokens += length
    parts.append(order[start:])
    return parts


def _merge_rank_stats(per_rank: list[dict]) -> tuple[dict[str, list[tuple[float, float]]], dict]:
    """The ranks' micro-batch stats as one list per name, and their mismatch sums added."""
    stats: dict[str, list[tuple[float, float]]] = {}
    sums: dict[str, list[float]] = {}
    for part in per_rank:
        for name, pairs in part["stats"].items():
            stats.setdefault(name, []).extend((float(v), float(w)) for v, w in pairs)
        for kind, values in part["mismatch"].items():
            sums[kind] = [a + b for a, b in zip(sums.get(kind, [0.0] * len(values)), values)]
    return stats, sums


# float32 forwards repeat to rounding; bf16 ones within its rounding (a GPU's atomic adds vary)
TRAIN_MODE_GAP_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}


class Learner:
    def __init__(
        self,
        cfg: JobConfig,
        model_dir: str,
        redis_url: str,
        credentials: JobCredentials | None = None,
        rank: int = 0,
        world_size: int = 1,
        master: str | None = None,
    ):
        """One rank of world_size; master is rank 0's "host:port" (LearnerGroup finds it)."""
        torch.set_num_threads(cfg.cluster.torch_threads)
        dump_stacks_on_sigusr1()  # on Ray this is the actor's own process
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.algo_cfg = cfg.algorithm
        lc = cfg.learner
        self.model_dir, self.lora = model_dir, lc.lora
        self.device = torch.device(lc.device)
        no_cudnn_attention(self.device)
        self.rank, self.world_size = rank, world_size
        # FSDP2 also for one rank with mixed precision: its policy casts to bf16 around fp32 masters.
        self.sharded = world_size > 1 or lc.mixed_precision
        if self.sharded:
            assert master is not None or world_size == 1, "a learner group's ranks need rank 0's address"
            master = master or sharding.free_local_address()
            sharding.init_group(rank, world_size, master, self.device, cfg.rollout.hang_timeout_s)
        self.policy = load_model(model_dir, "float32" if lc.mixed_precision else cfg.model.dtype, lc.device)
        if dropped := disable_dropout(self.policy):  # before the adapters: learner.lora.dropout stays
            log.info("learner: the model's dropout set to 0 (%d modules, e.g. %s)", len(dropped), dropped[0])
        if (gap := train_mode_gap(self.policy)) > TRAIN_MODE_GAP_TOLERANCE.get(self.policy.dtype, 1e-2):
            log.warning(
                "learner: the model's logits in training mode differ from eval mode by %.2g (relative) after its "
                "dropout was set to 0: a dropout or noise setting of the model is still on, so π_old and π are "
                "random and differ from the engine's behaviour logprobs (find it in the model's config)",
                gap,
            )
        self.policy.train()
        # Padding-free micro-batches when the model's packed logits match its own forward.
        self.packed = False
        self.packing_misfit = packing_misfit(self.policy) if lc.packing else "learner.packing=false"
        if self.packing_misfit is None:
            use_packed_attention(self.policy)  # before the reference copy and the critic: they pack too
            self.packed = True
        elif lc.packing:
            log.warning("learner.packing: padded micro-batches, because %s", self.packing_misfit)
        if self.lora is not None:  # a frozen base plus adapters (lora.py); the packed attention stays
            lora.apply_lora(self.policy, self.lora)
        # log π and entropy from the head's input, a chunk of positions at a time: no [T, V] logits (forwards.py)
        self.logit_chunk_misfit = use_logit_chunks(self.policy, lc.logit_chunk_tokens)  # the reference's copy too
        if self.logit_chunk_misfit and lc.logit_chunk_tokens:
            log.warning("learner.logit_chunk_tokens: whole logits, because %s", self.logit_chunk_misfit)
        if lc.activation_checkpointing:
            checkpoint_activations(self.policy)  # recomputes with the forward's replayed experts
        self.is_moe = hasattr(self.policy.config, "num_experts") or hasattr(self.policy.config, "num_local_experts")
        # learner_model_tflops and learner_mfu (flops.py): counted once, before the shards
        self.active_params, self.peak_tflops = flops.active_parameters(self.policy), flops.peak_tflops(self.device)
        self.replay = lc.routing_replay
        if self.replay and (misfit := replay_misfit(self.policy)):
            raise ValueError(f"learner.routing_replay: {misfit}")
        self.pad_id = self.policy.config.pad_token_id or 0
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        needs_ref = self.algo_cfg.kl_coef > 0 or any(s.coef > 0 for s in self.algo_cfg.kl_schedule)
        self.ref = None
        if needs_ref:  # LoRA: the policy itself is the reference, its adapters off (lora.as_reference)
            self.ref = self.policy if self.lora else copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.algorithm = make_algorithm(cfg)
        self.critic = None
        if self.algorithm.needs_critic:
            self.critic = ValueModel(model_dir, self.policy.dtype).to(self.device).train()
            disable_dropout(self.critic)
            if self.packed:  # the policy's architecture: its check covers the backbone
                use_packed_attention(self.critic.backbone)
                self.critic.packed = True
        if self.sharded:  # before the optimizers: they hold the shards
            for module in self._modules():
                sharding.shard(module, lc.mixed_precision)
        # Only the trainable parameters (LoRA: the adapters) get gradients and optimizer state.
        self.trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.optim = make_adamw(self.trainable, self.sharded, lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
        if self.critic is not None:
            self.critic_optim = make_adamw(self.critic.parameters(), self.sharded, lr=lc.critic_lr, betas=lc.betas)
        self.clip = AdaptiveClip(self.algo_cfg.adaptive_clip, self.algo_cfg.clip_low, self.algo_cfg.clip_high)
        self.kl_ctrl = None
        if (target := self.algo_cfg.kl_target) is not None:
            self.kl_ctrl = AdaptiveKL(self.algo_cfg.kl_coef, target, self.algo_cfg.kl_horizon)
        self.buffer = TrajectoryStore(
            JobConnection.of_job(cfg, redis_url, credentials.redis_password if credentials else None),
            cfg.buffer.lease_seconds,
        )
        self.version = self.buffer.get_policy_version()
        # reward.scope=group: rank 0 scores each group it claims (the workers score nothing then)
        self.group_rewards = GroupRewards(cfg, model_dir) if cfg.reward.scope == "group" and rank == 0 else None
        self.transport = None  # rank 0 publishes; the other ranks only gather their shards for it
        if rank == 0:
            self.transport = make_transport(
                cfg.weight_transport,
                prefix=f"slime_{cfg.job_name}",
                directory=cfg.run_dir / "weights",
                bucket_mb=cfg.weights.bucket_mb,
                num_receivers=cfg.rollout.num_workers,  # broadcast: every engine joins each collective
            )

    def _modules(self) -> list[torch.nn.Module]:
        """The policy, the reference (unless it is the policy: LoRA) and the critic, each once."""
        return list({id(m): m for m in (self.policy, self.ref, self.critic) if m is not None}.values())

    # ---- one training step -------------------------------------------------------------------
    def train_step(self, step: int, num_groups: int, max_staleness: int | None = None, commit: bool = True) -> dict:
        """Claim up to num_groups complete groups and run one update. With commit=False the groups stay
        claimed until the caller commits the step (the driver does at each checkpoint, so a crash
        before the checkpoint requeues them for the restored weights: each group trains exactly once).
        A learner group calls the two halves itself: rank 0 claims, every rank trains."""
        return self.train_claimed(self.claim_groups(step, num_groups, max_staleness), step, commit)

    def claim_groups(self, step: int, num_groups: int, max_staleness: int | None = None) -> dict:
        """Rank 0: the step's groups from the buffer, those beyond max_staleness dropped (and counted)."""
        started = time.time()
        kept, dropped_stale, wasted_tokens = [], 0, 0
        # A dropped group leaves the claimed set (not committed as trained) and the next ready group
        # takes its place, until the step has num_groups or none is ready.
        while len(kept) < num_groups:
            # Async (a staleness bound): in start order, the order the admission control counted on.
            groups = self.buffer.claim_groups(num_groups - len(kept), step, in_start_order=max_staleness is not None)
            if not groups:
                break
            for g in groups:
                versions = [s.min_version for s in g if s.min_version is not None]
                if max_staleness is not None and versions and self.version - min(versions) > max_staleness:
                    self.buffer.drop_claimed_group(g[0].group_id, "stale")
                    dropped_stale += 1
                    wasted_tokens += sum(s.response_length for s in g)
                else:
                    kept.append(g)
        scoring = self.group_rewards.score(kept, self.buffer) if self.group_rewards is not None and kept else {}
        metrics: dict = {
            **scoring,
            "step": step,
            "groups": len(kept),
            "dropped_stale_groups": dropped_stale,
            "dropped_stale_tokens": wasted_tokens,
        }
        return {"started": started, "groups": kept, "metrics": metrics}

    def train_claimed(self, claimed: dict, step: int, commit: bool = True) -> dict:
        """Every rank: one update on the groups claim_groups returned; rank 0 then publishes the new
        version number and (commit=True) marks the groups trained."""
        kept, metrics = claimed["groups"], dict(claimed["metrics"])
        samples = [s for g in kept for s in g]
        if samples:
            started = time.perf_counter()
            metrics.update(self.update(samples, [gi for gi, g in enumerate(kept) for _ in g], step))
            metrics.update(self._model_flops(metrics["batch_tokens"], time.perf_counter() - started, step))
        self.version += 1
        if self.rank == 0:
            self.buffer.set_policy_version(self.version)
            if commit:
                self.buffer.commit_step(step)
        metrics["policy_version"] = self.version
        metrics["learner_seconds"] = time.time() - claimed["started"]
        return metrics

    def update(
        self, samples: list[Sample], group_ids: list[int], step: int, unfinished: list[bool] | None = None
    ) -> dict:
        """One update on `samples` (group_ids: each sample's group). `unfinished` (streaming): rows
        whose trajectory goes on; their return is bootstrapped with the critic's V(s_end)."""
        batch = collate(samples, group_ids, self.pad_id).to(self.device)
        kl_coef = staged_kl_coef(step, self.algo_cfg.kl_schedule, self.algo_cfg.kl_coef)
        if self.kl_ctrl is not None:
            kl_coef = self.kl_ctrl.coef
        self._set_lr(step)
        # PPO's critic warmup: the critic learns the returns first; the policy is not stepped
        policy_frozen = self._policy_frozen(step)
        stale = stale_tokens(batch.versions, batch.mask, self.version)
        trainable_before = batch.mask.sum().clamp_min(1)
        batch.mask = off_policy_mask(batch.mask, stale, self.cfg.algorithm.correction.name)
        masked_stale = 1.0 - float(batch.mask.sum() / trainable_before)  # mask_stale's share; else 0
        with torch.no_grad():
            fixed = self._prepare(batch, kl_coef, unfinished)
        fixed.version_lag = (self.version - batch.versions).clamp_min(0)
        correction = self.algorithm.correction
        correction_stats: dict[str, float] = {}
        if correction.batch_level:  # its weights depend on the whole batch: computed once, here
            assert fixed.old_logp is not None  # _prepare recomputes π_old for batch-level corrections
            applied = correction(
                CorrectionInputs(fixed.old_logp, batch.behaviour_logp, batch.mask, fixed.advantages, fixed.version_lag)
            )
            fixed.is_weights, correction_stats = applied.weights, applied.stats
        # The metrics report the clip range this update used (adaptive clip moves it afterwards).
        clip_low, clip_high = self.clip.clip_low, self.clip.clip_high
        stats, grad_norms, critic_grad_norms, mismatch = self._optimize(
            batch, fixed, kl_coef, clip_low, clip_high, policy_frozen
        )

        # Maxima stay maxima over the micro-batches. Losses are weighted as the gradient accumulated
        # them, so they report the objective each minibatch optimized (averaged over minibatches);
        # everything else by trainable tokens: a share or mean over the batch's tokens, not its parts.
        out = {k: _aggregate(k, [v for v, _ in pairs], [w for _, w in pairs]) for k, pairs in stats.items()}
        out.update(correction_stats)
        if masked_stale > 0:  # masked before the correction saw the batch: its own share reads 0
            out["offpolicy_masked_share"] = masked_stale
        out.update(mismatch.metrics())
        if self.algo_cfg.adaptive_clip.enabled and "approx_kl" in out:
            self.clip.update(out["approx_kl"])
        out.update(fixed.metrics)
        out.update(self._batch_metrics(samples, batch, stale))
        measured_kl = out.get("kl_reward_mean", out.get("kl"))  # per token, to the reference
        if self.kl_ctrl is not None and measured_kl is not None:
            self.kl_ctrl.update(measured_kl, len(samples))
        out.update(
            grad_norm=float(np.mean(grad_norms)),
            skipped_updates=sum(not math.isfinite(n) for n in grad_norms + critic_grad_norms),
            zero_grad_updates=sum(n == 0.0 for n in ([] if policy_frozen else grad_norms) + critic_grad_norms),
            kl_coef=kl_coef,
            clip_low=clip_low,
            clip_high=clip_high,
            lr=self.optim.param_groups[0]["lr"],
            learner_packed=float(self.packed),
        )
        if self.critic is not None:
            out["critic_lr"] = self.critic_optim.param_groups[0]["lr"]
            out["policy_frozen"] = float(policy_frozen)
        if critic_grad_norms:
            out["critic_grad_norm"] = float(np.mean(critic_grad_norms))
        out["reward_stats"] = _reward_stats(samples)
        if info_means := _reward_info_means(samples):
            out["reward_info"] = info_means
        return out

    def _policy_frozen(self, step: int) -> bool:
        return self.critic is not None and step < self.cfg.learner.critic_warmup_steps

    def _model_flops(self, batch_tokens: int, seconds: float, step: int) -> dict[str, float]:
        """learner_model_tflops (and learner_mfu on a GPU of known peak) of an update that took
        `seconds`: the policy's training passes over the whole batch, per rank (the ranks share it).
        LoRA's frozen base computes no weight gradients: 4 x N a token, not 6 x N."""
        passes = 0 if self._policy_frozen(step) else self.cfg.learner.ppo_epochs
        model_flops = flops.training_flops(self.active_params, batch_tokens, passes) * (4 / 6 if self.lora else 1)
        tflops = model_flops / max(seconds, 1e-9) / self.world_size / 1e12
        return {"learner_model_tflops": tflops} | (
            {"learner_mfu": tflops / self.peak_tflops} if self.peak_tflops else {}
        )

    def _prepare(self, batch: Batch, kl_coef: float, unfinished: list[bool] | None) -> UpdateTensors:
        """The quantities fixed for the whole update: π_ref, V_old, π_old (when recomputed), then
        the algorithm's advantages and returns."""
        lc = self.cfg.learner
        ref_logp = old_values = old_logp = bootstrap = None
        if self.ref is not None and kl_coef > 0:
            with lora.as_reference(self.ref):  # LoRA: the base, adapters off
                ref_logp = self._per_row(
                    batch, lambda sub: response_logprobs(self.ref, sub, self.temperature, packed=self.packed)[0]
                )
        if self.critic is not None:
            old_values = self._per_row(batch, self.critic)
            if unfinished is not None:
                last_values = self._per_row(batch, lambda sub: self.critic(sub, with_last=True)[1][:, None])[:, 0]
                # V(s_end) where the trajectory goes on; 0 where it ended (a terminal state).
                bootstrap = torch.where(torch.tensor(unfinished, device=self.device), last_values, 0.0)
        if lc.recompute_old_logprobs or lc.ppo_epochs * lc.num_minibatches > 1 or self.algorithm.correction.batch_level:
            old_logp = self._per_row(
                batch,
                lambda sub: response_logprobs(
                    self.policy, sub, self.temperature, replay=self.replay, packed=self.packed
                )[0],
            )
        return self.algorithm.prepare(
            batch,
            kl_coef=kl_coef,
            old_logp=old_logp,
            ref_logp=ref_logp,
            old_values=old_values,
            bootstrap_values=bootstrap,
        )

    def _my_micro_batches(self, batch: Batch, idx: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        """This rank's micro-batches of the rows `idx` (their token-balanced share), and how many
        empty passes it adds so that every rank runs as many forwards and backwards: FSDP2's
        gathers and reductions are collectives."""
        lc = self.cfg.learner

        def cut(rows: torch.Tensor) -> list[torch.Tensor]:
            if not len(rows):
                return []
            return _micro_batches(batch, rows, lc.micro_batch_size, lc.max_tokens_per_micro_batch, self.packed)

        if self.world_size == 1:
            return cut(idx), 0
        shares = sharding.split_rows(batch.last_pos[idx].tolist(), self.world_size)
        # every rank cuts every share the same way, so each knows how many passes the others run
        per_rank = [cut(idx[torch.tensor(share, dtype=torch.long, device=idx.device)]) for share in shares]
        parts = per_rank[self.rank]
        return parts, max(len(p) for p in per_rank) - len(parts)

    def _per_row(self, batch: Batch, fn) -> torch.Tensor:
        """fn(micro-batch) -> [rows, T'] for every row, assembled into [N, T] (zeros beyond T').
        Ranks compute their own rows and sum the zero-filled rest: exact, each row has one owner."""
        n, t = batch.mask.shape
        out = torch.zeros((n, t), device=batch.mask.device)
        parts, empty_passes = self._my_micro_batches(batch, torch.arange(n, device=batch.mask.device))
        for idx in parts:
            values = fn(batch.rows(idx))
            out[idx, : values.shape[1]] = values
        for _ in range(empty_passes):
            fn(batch.rows(torch.arange(1, device=batch.mask.device)))
        return sharding.sum_across_ranks(out) if self.world_size > 1 else out

    def _empty_pass(self, sub: Batch, with_aux: bool) -> None:
        """A forward and backward that adds nothing to any gradient: a rank with fewer micro-batches
        than the others still joins every collective of theirs."""
        logp, _, aux = response_logprobs(
            self.policy, sub, self.temperature, with_aux=with_aux, replay=self.replay, packed=self.packed
        )
        loss = logp.sum() * 0.0 + (aux * 0.0 if aux is not None else 0.0)
        if self.critic is not None:
            loss = loss + self.critic(sub).sum() * 0.0
        loss.backward()

    def _set_lr(self, step: int) -> None:
        """learner.lr and critic_lr at this step's point of the warmup and decay (schedules.lr_factor)."""
        lc = self.cfg.learner
        factor = lr_factor(step, self.cfg.steps, lc)
        optims = [(self.optim, lc.lr)] + ([(self.critic_optim, lc.critic_lr)] if self.critic is not None else [])
        for optim, lr in optims:
            for group in optim.param_groups:
                group["lr"] = lr * factor

    def _optimize(
        self,
        batch: Batch,
        fixed: UpdateTensors,
        kl_coef: float,
        clip_low: float,
        clip_high: float,
        policy_frozen: bool = False,
    ) -> tuple[dict[str, list[tuple[float, float]]], list[float], list[float], MismatchMeter]:
        """ppo_epochs x num_minibatches optimizer steps (policy_frozen: the critic's only); each
        minibatch's gradient accumulates over micro-batches. Returns the per-micro-batch loss stats
        as (value, weight) pairs, the per-step gradient norms and the engine-vs-learner mismatch of
        the trained tokens (measured against π_old)."""
        lc = self.cfg.learner
        mismatch = MismatchMeter()
        with_aux = self.is_moe and self.algo_cfg.router_aux_coef > 0
        stats: dict[str, list[tuple[float, float]]] = {}
        grad_norms: list[float] = []
        critic_grad_norms: list[float] = []
        for epoch in range(lc.ppo_epochs):
            order = torch.randperm(batch.mask.shape[0], device=self.device)
            if self.world_size > 1:  # one order for every rank, whatever their RNG did
                sharding.broadcast_from_rank0(order)
            for mini in order.chunk(lc.num_minibatches):
                self.optim.zero_grad(set_to_none=True)
                if self.critic is not None:
                    self.critic_optim.zero_grad(set_to_none=True)
                mini_tokens = batch.mask[mini].sum().clamp_min(1)
                mini_seqs = (batch.mask[mini].sum(-1) > 0).sum().clamp_min(1)
                parts, empty_passes = self._my_micro_batches(batch, mini)
                for _ in range(empty_passes):
                    self._empty_pass(batch.rows(mini[:1]), with_aux)
                for part in parts:
                    sub = batch.rows(part)
                    # Each micro-batch's aggregate is weighted by its share of the minibatch's
                    # tokens (token_mean) or sequences, so accumulation equals one big batch; over
                    # ranks too: the shares are of the global minibatch, and x ranks undoes FSDP2's
                    # average of the ranks' gradients.
                    if self.algo_cfg.loss_agg == "token_mean":
                        weight = sub.mask.sum() / mini_tokens
                    else:
                        weight = (sub.mask.sum(-1) > 0).sum() / mini_seqs
                    if weight == 0:
                        if self.sharded:
                            self._empty_pass(sub, with_aux)
                        continue
                    logp, entropy, aux = response_logprobs(
                        self.policy,
                        sub,
                        self.temperature,
                        with_entropy=True,
                        with_aux=with_aux,
                        replay=self.replay,
                        packed=self.packed,
                        entropy_grad=self.algo_cfg.entropy_coef > 0,
                    )
                    values = self.critic(sub) if self.critic is not None else None
                    loss, st = self.algorithm.loss(
                        sub,
                        fixed.rows(part, sub.mask.shape[1]),
                        Forward(logp, entropy, aux, values),
                        clip_low=clip_low,
                        clip_high=clip_high,
                        kl_coef=kl_coef,
                    )
                    (loss * (weight * self.world_size)).backward()
                    # Engine vs learner logprobs of the same tokens: ~0 on-policy; large means the
                    # engine and learner disagree (stale weights, numerics, or a bug).
                    st["behaviour_logp_abs_diff"] = masked_mean(
                        (logp.detach() - sub.behaviour_logp).abs(), sub.mask
                    ).item()
                    if epoch == 0:  # each row once, against π_old
                        old = fixed.old_logp[part, : sub.mask.shape[1]] if fixed.old_logp is not None else logp
                        mismatch.add(old.detach(), sub.behaviour_logp, sub.mask, sub.versions, self.version)
                    tokens = float(sub.mask.sum())
                    for k, v in st.items():
                        # A loss is the objective this micro-batch adds to (its accumulation weight);
                        # every other stat is a token mean or share (its trainable tokens).
                        stats.setdefault(k, []).append((v, float(weight) if k.endswith("loss") else tokens))
                grad_norms.append(sharding.clip_grad_norm(self.trainable, lc.grad_clip))
                if not policy_frozen:
                    _step_if_finite(self.optim, grad_norms[-1], "policy")
                if self.critic is not None:
                    critic_grad_norms.append(sharding.clip_grad_norm(self.critic.parameters(), lc.grad_clip))
                    _step_if_finite(self.critic_optim, critic_grad_norms[-1], "critic")
        if self.world_size > 1:  # every rank reports what all of them computed
            stats, mismatch.sums = _merge_rank_stats(sharding.gather_json({"stats": stats, "mismatch": mismatch.sums}))
        return stats, grad_norms, critic_grad_norms, mismatch

    def _batch_metrics(self, samples: list[Sample], batch: Batch, stale: torch.Tensor) -> dict:
        """What was trained on: rewards, lengths, tokens, staleness."""
        lengths = np.array([s.response_length for s in samples])
        ok = [s for s in samples if s.status != Status.FAILED and s.reward is not None]
        by_task: dict[str, list[float]] = {}
        for s in ok:
            by_task.setdefault(str(s.metadata.get("task", "default")), []).append(float(s.reward))
        return dict(
            reward_mean=float(np.mean([s.reward for s in ok])) if ok else float("nan"),
            reward_std=float(np.std([s.reward for s in ok])) if ok else float("nan"),
            reward_by_task={k: float(np.mean(v)) for k, v in by_task.items()},
            samples=len(samples),
            failed_samples=sum(s.status == Status.FAILED for s in samples),  # not the unscored (streaming)
            failures_by_reason=_failures_by_reason(samples),
            truncated_share=float(batch.truncated.float().mean()),
            response_len_mean=float(lengths.mean()),
            response_len_p50=float(np.percentile(lengths, 50)),
            response_len_p99=float(np.percentile(lengths, 99)),
            trained_tokens=int(batch.mask.sum().item()),
            batch_tokens=int(batch.attention_mask.sum().item()),  # prompts and responses: what the forwards read
            # Share of the batch's generated tokens that an older policy produced (before any masking).
            off_policy_token_share=float(stale.float().sum() / max(1, sum(s.response_length for s in samples))),
            version_lag_hist=_histogram([self.version - s.min_version for s in samples if s.min_version is not None]),
            version_span_hist=_histogram([s.version_span for s in samples]),
            resumed_samples=sum(1 for s in samples if s.version_span > 0),
        )

    def train_segments(self, step: int, max_segments: int, chunk_tokens: int) -> dict:
        """Streaming variant: train on every trajectory's new tokens (>= chunk_tokens of them, or its
        end) before the trajectory finishes. Earlier tokens are context only (loss mask 0)."""
        return self.train_claimed_segments(self.claim_segments(max_segments, chunk_tokens, step), step)

    def claim_segments(self, max_segments: int, chunk_tokens: int, step: int) -> dict:
        """Rank 0: the segments of train_segments, claimed from the buffer."""
        return {"started": time.time(), "segments": self.buffer.claim_segments(chunk_tokens, max_segments, step)}

    def train_claimed_segments(self, claimed: dict, step: int) -> dict:
        """Every rank: one update on the segments claim_segments returned."""
        samples, unfinished = [], []
        for sample, start, final in claimed["segments"]:
            sample.loss_mask = sample.loss_mask.copy()
            sample.loss_mask[:start] = 0
            if not final:
                sample.reward = None  # the return comes from the critic's bootstrap
            samples.append(sample)
            unfinished.append(not final)
        metrics: dict = {"step": step, "segments": len(samples), "final_segments": unfinished.count(False)}
        if samples:
            started = time.perf_counter()
            metrics.update(self.update(samples, list(range(len(samples))), step, unfinished))
            metrics.update(self._model_flops(metrics["batch_tokens"], time.perf_counter() - started, step))
        self.version += 1
        if self.rank == 0:
            self.buffer.set_policy_version(self.version)
        metrics["policy_version"] = self.version
        metrics["learner_seconds"] = time.time() - claimed["started"]
        return metrics

    def set_correction_cap(self, tis_cap: float) -> None:
        """algorithm.correction.auto: the correction's cap c from the next update on (the driver's
        controller decides it, slime/algorithms/offpolicy_controller.py)."""
        settings = self.algo_cfg.correction.model_copy(update={"tis_cap": float(tis_cap)})
        self.algorithm.correction = make_correction(settings, (self.algo_cfg.clip_low, self.algo_cfg.clip_high))

    # ---- weights -----------------------------------------------------------------------------
    def publish_weights(self) -> WeightHandle | None:
        """Rank 0 publishes (a handle); sharded, each parameter is gathered from the ranks as the
        transport packs it, one at a time, so no rank holds a second whole copy of the model. The
        other ranks join those gathers in the same order and return None. With learner.lora, only the
        adapters: `{module}.lora_A.weight` and `{module}.lora_B.weight` (lora.py, the push contract)."""
        named = lora.adapter_tensors(self.policy) if self.lora else self.policy.named_parameters()
        if self.transport is None:
            for _, param in named:
                sharding.full_tensor(param.detach())
            return None
        return self.transport.publish(self.version, named)

    @torch.no_grad()
    def weight_checksums(self, dtypes: dict[str, str]) -> dict[str, Checksum]:
        """The policy's checksums (slime/weights/checksum.py) of the tensors an engine reported, cast to
        its dtypes; tied aliases under each of their names. Sharded, every rank joins each gather."""
        full = (
            (name, sharding.full_tensor(p.detach()))
            for name, p in self.policy.named_parameters(remove_duplicate=False)
            if name in dtypes
        )
        if self.rank != 0:  # it joins the gathers; rank 0 alone sums
            for _ in full:
                pass
            return {}
        return checksums_as(full, dtypes)

    @torch.no_grad()
    def probe_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> np.ndarray:
        """Logprobs of a fixed probe response, to check an engine holds exactly these weights."""
        s = Sample(group_id="probe", index=0, prompt_ids=prompt_ids, max_new_tokens=len(response_ids))
        s.append(response_ids, np.zeros(len(response_ids)), self.version)
        batch = collate([s], [0], self.pad_id).to(self.device)
        self.policy.eval()
        logp = response_logprobs(self.policy, batch, self.temperature, packed=self.packed)[0][0]
        self.policy.train()
        sharding.reshard(self.policy)  # the parameters a push or a checksum reads are the master weights
        return logp.cpu().numpy()

    def memory(self) -> dict[str, float]:
        """This rank's parameters, gradients and optimizer state in bytes (its shards when sharded),
        and its process's resident set, now and at its peak (Linux)."""
        modules = self._modules()
        optims = [self.optim] + ([self.critic_optim] if self.critic is not None else [])
        params = [p for m in modules for p in m.parameters()]
        out = {
            "param_bytes": float(sum(sharding.local_bytes(p) for p in params)),
            "grad_bytes": float(sum(sharding.local_bytes(p.grad) for p in params if p.grad is not None)),
            "optimizer_bytes": float(
                sum(
                    sharding.local_bytes(v)
                    for o in optims
                    for st in o.state.values()
                    for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim()
                )
            ),
        }
        status = Path("/proc/self/status")
        if status.exists():
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            out["rss_bytes"] = float(fields["VmRSS"].split()[0]) * 1024
            out["peak_rss_bytes"] = float(fields["VmHWM"].split()[0]) * 1024
        return out

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, directory: str) -> None:
        """One rank: the Hugging Face policy directory and the optimizer state. Sharded: every rank
        writes its shards (torch.distributed.checkpoint), which any number of ranks can load.
        learner.lora: adapter/ and base_model.json instead of the policy (lora.py); sharded, the
        shards hold the adapters and their optimizer state, not the frozen base."""
        path = Path(directory)
        try:
            self._save(path)
        except UserError:
            raise
        except (OSError, RuntimeError) as exc:  # torch.save on a full disk: "basic_ios::clear: iostream error"
            free = shutil.disk_usage(path if path.exists() else path.parent).free
            raise sharding.CheckpointError(
                f"cannot write checkpoint {path}: {type(exc).__name__}: {exc} ({free / 2**20:.0f} MiB free on its "
                "file system)"
            ) from exc

    def _save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        if self.sharded:
            critic_optim = self.critic_optim if self.critic is not None else None
            only_adapters = self.lora is not None
            sharding.save_sharded(path, self.policy, self.optim, self.critic, critic_optim, only_adapters)
            if self.lora is not None:  # every rank joins the gathers, rank 0 writes
                lora.save_adapter(path, self.policy, self.lora, self.model_dir, write=self.rank == 0)
            if self.rank == 0:
                info = {"version": self.version, "clip": self.clip.state_dict(), "ranks": self.world_size}
                if self.kl_ctrl is not None:
                    info["kl_ctrl"] = self.kl_ctrl.state_dict()
                (path / "learner.json").write_text(json.dumps(info))
            return
        if self.lora is not None:
            lora.save_adapter(path, self.policy, self.lora, self.model_dir, write=True)
        else:
            self.policy.save_pretrained(path / "policy")
        state = {
            "optim": self.optim.state_dict(),
            "clip": self.clip.state_dict(),
            **({"kl_ctrl": self.kl_ctrl.state_dict()} if self.kl_ctrl is not None else {}),
            "version": self.version,
            "rng": torch.get_rng_state(),  # the minibatch order goes on after a resume
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optim"] = self.critic_optim.state_dict()
        torch.save(state, path / "learner_state.pt")
        (path / "learner.json").write_text(json.dumps({"version": self.version}))

    def load(self, directory: str) -> int:
        """A checkpoint of any number of ranks, into this learner's (N to M)."""
        path = Path(directory)
        try:
            self._load(path)
        except UserError:
            raise
        except Exception as exc:  # a truncated file: safetensors' "invalid header length", no path
            raise sharding.CheckpointError(f"cannot load checkpoint {path}: {type(exc).__name__}: {exc}") from exc
        self._apply_optimizer_settings()
        if self.rank == 0:
            self.buffer.set_policy_version(self.version)
        return self.version

    def _load(self, path: Path) -> None:
        lora.check_checkpoint(path, self.lora, self.policy, self.model_dir)  # LoRA or not, modules, base
        critic_optim = self.critic_optim if self.critic is not None else None
        if (path / sharding.CHECKPOINT_DIR).is_dir():
            sharding.load_sharded(path, self.policy, self.optim, self.critic, critic_optim, self.lora is not None)
            info = json.loads((path / "learner.json").read_text())
            self.clip.load_state_dict(info["clip"])
            self._load_kl_ctrl(info)
            self.version = int(info["version"])
        else:
            # from_pretrained, not the raw files: transformers converts its on-disk layout (e.g.
            # per-expert MoE weights) back to the in-memory one.
            if self.lora is not None:  # the adapters only, checked against this policy's
                saved = lora.adapter_state_for(self.policy, lora.read_adapter(path), str(path))
            else:
                saved = load_model(path / "policy", self.cfg.model.dtype, "cpu").state_dict()
            # weights_only: tensors and plain containers only; a crafted checkpoint cannot run code.
            state = torch.load(path / "learner_state.pt", weights_only=True)
            if self.sharded:  # a 1-rank checkpoint, dealt out to this rank's shards
                sharding.load_full(self.policy, self.optim, saved, state["optim"])
                if self.critic is not None and "critic" in state:
                    sharding.load_full(self.critic, critic_optim, state["critic"], state["critic_optim"])
            else:
                try:
                    self.policy.load_state_dict(saved, strict=self.lora is None)
                except RuntimeError as exc:  # its message lists every tensor: keep the first
                    lines = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()]
                    raise sharding.CheckpointError(
                        f"resume: {path} holds a policy of another shape than this job's model (model.path or "
                        f"model.tiny changed since it was written?): {lines[0] if lines else exc}"
                    ) from exc
                self.optim.load_state_dict(state["optim"])
                if self.critic is not None and "critic" in state:
                    self.critic.load_state_dict(state["critic"])
                    self.critic_optim.load_state_dict(state["critic_optim"])
            del saved
            if "rng" in state:  # checkpoints from before 2026-12-03 have none
                torch.set_rng_state(state["rng"])
            self.clip.load_state_dict(state["clip"])
            self._load_kl_ctrl(state)
            self.version = int(state["version"])

    def _load_kl_ctrl(self, state: dict) -> None:
        """The adaptive β goes on from the checkpoint's (one written without it: from kl_coef)."""
        if self.kl_ctrl is not None and "kl_ctrl" in state:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])

    def _apply_optimizer_settings(self) -> None:
        """A loaded optimizer state brings the checkpoint's param_groups (lr, betas, weight_decay):
        the config's values win, as a resume with a new learner.lr asks (the moments are kept)."""
        lc = self.cfg.learner
        optims = [(self.optim, {"lr": lc.lr, "betas": tuple(lc.betas), "weight_decay": lc.weight_decay})]
        if self.critic is not None:
            optims.append((self.critic_optim, {"lr": lc.critic_lr, "betas": tuple(lc.betas)}))
        if lc.lr_warmup_steps or lc.lr_schedule != "constant":  # the checkpoint's lr was a scheduled one
            for _, settings in optims:
                del settings["lr"]  # update() sets it for each step
        for optim, settings in optims:
            for group in optim.param_groups:
                old = {k: tuple(group[k]) if k == "betas" else group[k] for k in settings}
                changed = {k: f"{old[k]} -> {v}" for k, v in settings.items() if old[k] != v}
                if changed and self.rank == 0:
                    log.warning("resumed optimizer: the config's values replace the checkpoint's: %s", changed)
                group.update(settings)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.group_rewards is not None:
            self.group_rewards.close()
        if self.sharded and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
