"""The driver's handle on the learner: learner.num_ranks actors of the job's launcher (actor.py's
Learner, one per rank) placed from the config, joined in one torch.distributed group, called as one.

Each call goes to every rank (FSDP2's forwards are collectives) and returns their refs; `result`
waits for all of them, raises the first failure at once, and gives rank 0's answer. Claims stay
on rank 0: it claims the step's groups once, and the others receive the claimed groups through
Ray's object store (numpy arrays: no copy on one node).

The launcher (slime/launch/launcher.py: Ray's, or one thread of the driver's process for the one
rank cluster.launcher=local allows) starts the ranks and reads their answers; Ray is imported
only by the placement and the rendezvous of several ranks, which need it.
"""

from __future__ import annotations

import socket
from typing import Any

from slime.config import JobConfig
from slime.errors import UserError
from slime.learner.actor import Learner
from slime.security import JobCredentials


class ResourceError(UserError, RuntimeError):
    """The Ray cluster lacks a resource the job's config asks for."""

    hint = "ask for less (learner.num_ranks, rollout.num_workers, *.device) or add machines to the cluster (docs/cluster.md)"


def learner_resources(cfg: JobConfig) -> dict[str, float]:
    """What the learner ranks reserve, summed: CPUs (learner.cpus_per_rank), a GPU per rank on CUDA,
    and learner.resources_per_rank."""
    lc = cfg.learner
    need = {"CPU": lc.cpus_per_rank, "GPU": 1.0 if lc.device.startswith("cuda") else 0.0, **lc.resources_per_rank}
    return {name: amount * lc.num_ranks for name, amount in need.items() if amount > 0}


def gpus_per_engine(cfg: JobConfig) -> int:
    """The GPUs one rollout worker's engine uses: vLLM's tensor-parallel size, the launched SGLang
    servers' (tensor-parallel size x sglang.num_servers); 1 for the built-in engine."""
    r = cfg.rollout
    if r.engine == "vllm":
        return cfg.vllm.tensor_parallel_size
    sg = cfg.sglang
    if r.engine == "sglang" and sg.url is None and not sg.urls:
        return sg.tensor_parallel_size * sg.num_servers
    return 1


def required_resources(cfg: JobConfig) -> dict[str, float]:
    """What the job needs from the cluster: the learner's resources, and gpus_per_engine per rollout
    engine on CUDA. cluster.placement=colocated: ranks and engines share GPUs (the larger count is needed);
    disaggregated: one GPU each. (Rollout workers reserve no CPU: they mostly wait.)"""
    need = learner_resources(cfg)
    for name, amount in cfg.rollout.resources_per_worker.items():
        need[name] = need.get(name, 0.0) + amount * cfg.rollout.num_workers
    engine_gpus = (
        float(cfg.rollout.num_workers * gpus_per_engine(cfg)) if cfg.rollout.device.startswith("cuda") else 0.0
    )
    if engine_gpus:
        learner_gpus = need.get("GPU", 0.0)
        colocated = cfg.cluster.placement == "colocated"
        need["GPU"] = max(learner_gpus, engine_gpus) if colocated else learner_gpus + engine_gpus
    return need


def check_resources(cfg: JobConfig, available: dict[str, float], where: str) -> None:
    """Fail at once, naming each missing resource and the settings that ask for it."""
    missing = [
        f"{name}: needs {amount:g}, {where} has {available.get(name, 0.0):g}"
        for name, amount in required_resources(cfg).items()
        if available.get(name, 0.0) < amount
    ]
    if missing:
        lc, r = cfg.learner, cfg.rollout
        raise ResourceError(
            f"the job does not fit: {'; '.join(missing)} (learner.num_ranks={lc.num_ranks}, "
            f"learner.device={lc.device}, learner.cpus_per_rank={lc.cpus_per_rank:g}, "
            f"learner.resources_per_rank={lc.resources_per_rank}, rollout.num_workers={r.num_workers}, "
            f"rollout.device={r.device}, cluster.placement={cfg.cluster.placement})"
        )


GPU_SHARE = 0.5  # colocated: rank i and engine i each take half of bundle i's GPU, so Ray gives both that GPU


def shared_gpus(cfg: JobConfig) -> int:
    """Colocated CUDA engines: the GPUs that rank i and engine i share (bundle i of the learner's
    placement group), the larger of the two counts; 0 where nothing is shared on a GPU."""
    if cfg.cluster.placement != "colocated" or not cfg.rollout.device.startswith("cuda"):
        return 0
    if gpus_per_engine(cfg) > 1:  # a tensor-parallel engine reserves none and sees every GPU of its node
        return 0
    ranks = cfg.learner.num_ranks if cfg.learner.device.startswith("cuda") else 0
    return max(cfg.rollout.num_workers, ranks)


def _bundles(cfg: JobConfig, per_rank: dict[str, float]) -> list[dict[str, float]]:
    """The learner's placement group: a bundle per rank or, colocated on GPUs, one per shared GPU,
    holding that GPU, the rank's CPUs and resources, and the engine's rollout.resources_per_worker."""
    n, gpus = cfg.learner.num_ranks, shared_gpus(cfg)
    if not gpus:
        return [per_rank] * n
    rank_part = {k: v for k, v in per_rank.items() if k != "GPU"}
    # A CPU learner's ranks share no GPU and may outnumber the engines: those beyond get a bundle of
    # their own resources, if they reserve any (else none: they are placed outside the group).
    return [
        ({"GPU": 1.0} if i < gpus else {})
        | (rank_part if i < n else {})
        | (cfg.rollout.resources_per_worker if i < cfg.rollout.num_workers else {})
        for i in range(max(gpus, n) if rank_part else gpus)
    ]


def _free_address() -> str:
    """host:port for rank 0's rendezvous, found on rank 0's node (this runs in its bundle)."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


class LearnerGroup:
    def __init__(
        self, cfg: JobConfig, model_dir: str, redis_url: str, credentials: JobCredentials | None, launcher: Any
    ):
        """``launcher``: the job's, a slime.launch.launcher.Launcher (this room sits below it)."""
        self.launcher = launcher
        n = cfg.learner.num_ranks
        where = "the Ray cluster" if launcher.name == "ray" else "this machine"
        check_resources(cfg, launcher.cluster_resources(), where)
        self.placement = None
        strategies: list[dict[str, Any]] = [{} for _ in range(n)]
        per_rank = {name: amount / n for name, amount in learner_resources(cfg).items()}
        # Colocated on Ray with CUDA engines: bundle i holds GPU i, shared by rank i and engine i
        # (worker_placement); without it an actor reserving no GPU sees every GPU and runs on GPU 0.
        self.shared_gpus = shared_gpus(cfg) if launcher.name == "ray" else 0
        if self.shared_gpus and "GPU" in per_rank:
            per_rank["GPU"] = GPU_SHARE
        elif n == 1 and cfg.cluster.placement == "colocated":
            # one rank shares its GPU with the engines (CUDA IPC); like them, it reserves none. Disaggregated,
            # it reserves its own: else Ray leaves it every GPU of the node and "cuda" is GPU 0, an engine's.
            per_rank.pop("GPU", None)
        if (per_rank or self.shared_gpus) and launcher.name == "ray":
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            # PACK: the ranks on as few nodes as fit (their collectives are the learner's hot path).
            bundles = _bundles(cfg, per_rank)
            self.placement = launcher.placement_group(bundles, "PACK", f"{cfg.job_name}-learner")
            try:
                ray.get(self.placement.ready(), timeout=60)
            except ray.exceptions.GetTimeoutError:
                launcher.remove_placement_group(self.placement)
                raise ResourceError(
                    f"the learner's {n} ranks ({per_rank} each) could not be placed within 60 s: "
                    "the cluster has the resources but they are in use"
                ) from None
            strategies = [
                {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        self.placement, placement_group_bundle_index=i
                    )
                }
                if i < len(bundles)
                else {}
                for i in range(n)
            ]
        # Resources come from the bundle; outside one, num_cpus=0: the learner mostly waits on the engines.
        options = [
            {**s, "num_cpus": per_rank.get("CPU", 0), "num_gpus": per_rank.get("GPU", 0)}
            | ({"resources": {k: v for k, v in per_rank.items() if k not in ("CPU", "GPU")}} if per_rank else {})
            for s in strategies
        ]
        master = None
        if n > 1:  # several ranks: Ray only (cluster.launcher=local allows one)
            import ray

            master = ray.get(ray.remote(_free_address).options(num_cpus=0, **strategies[0]).remote())
        self.ranks = [
            launcher.actor(
                Learner,
                cfg,
                model_dir,
                redis_url,
                credentials,
                rank,
                n,
                master,
                name=f"learner-{rank}",
                options=options[rank],
            )
            for rank in range(n)
        ]

    def worker_placement(self, index: int) -> tuple[Any, int] | None:
        """(placement group, bundle) where rollout worker ``index`` runs beside rank ``index`` on
        their shared GPU, taking GPU_SHARE of it; None: the worker is placed on its own."""
        return (self.placement, index) if index < self.shared_gpus else None

    # ---- calls: each returns the ranks' refs; result() waits for them -------------------------------
    def train_step(self, step: int, num_groups: int, max_staleness: int | None, commit: bool) -> list:
        if len(self.ranks) == 1:
            return [self.ranks[0].train_step.remote(step, num_groups, max_staleness, commit=commit)]
        claimed = self.ranks[0].claim_groups.remote(step, num_groups, max_staleness)
        return [r.train_claimed.remote(claimed, step, commit) for r in self.ranks]

    def train_segments(self, step: int, max_segments: int, chunk_tokens: int) -> list:
        if len(self.ranks) == 1:
            return [self.ranks[0].train_segments.remote(step, max_segments, chunk_tokens)]
        claimed = self.ranks[0].claim_segments.remote(max_segments, chunk_tokens, step)
        return [r.train_claimed_segments.remote(claimed, step) for r in self.ranks]

    def set_correction_cap(self, tis_cap: float) -> list:
        return [r.set_correction_cap.remote(tis_cap) for r in self.ranks]

    def publish_weights(self) -> list:
        return [r.publish_weights.remote() for r in self.ranks]

    def probe_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list:
        return [r.probe_logprobs.remote(prompt_ids, response_ids) for r in self.ranks]

    def weight_checksums(self, dtypes: dict[str, str]) -> list:
        return [r.weight_checksums.remote(dtypes) for r in self.ranks]

    def save(self, directory: str) -> list:
        return [r.save.remote(directory) for r in self.ranks]

    def load(self, directory: str) -> list:
        return [r.load.remote(directory) for r in self.ranks]

    def close(self) -> list:
        return [r.close.remote() for r in self.ranks]

    def result(self, refs: list, timeout: float | None = None):
        """Rank 0's answer once every rank has answered. A rank that failed raises at once: the
        others would wait for it in a collective."""
        pending = list(refs)
        while pending:
            ready, pending = self.launcher.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                raise self.launcher.timeout_error(f"{len(pending)} learner ranks did not answer in {timeout}s")
            self.launcher.get(ready[0])
        return self.launcher.get(refs[0])

    def kill(self) -> None:
        for r in self.ranks:
            self.launcher.kill(r)
        if self.placement is not None:
            self.launcher.remove_placement_group(self.placement)
            self.placement = None
