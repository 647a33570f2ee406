"""How the job's actors run: the seam between the job and its launcher.

`Launcher` is what the fleet, the learner group and the job use to start and call their actors:
Ray's (slime/launch/ray_cluster.py: cluster.launcher=ray) or threads of the driver's process
(slime/launch/local.py: cluster.launcher=local). An actor's methods are called as on Ray,
``actor.method.remote(...)``, and their results read through the launcher's get and wait. This
file also starts the rollout workers, the same way under both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from slime.config import JobConfig
from slime.learner.group import GPU_SHARE, gpus_per_engine
from slime.rollout import RolloutWorker
from slime.security import JobCredentials


class Launcher(Protocol):
    name: str  # "ray" | "local": cluster.launcher
    timeout_error: type[BaseException]  # what get and wait raise past their timeout
    call_errors: tuple[type[BaseException], ...]  # what a call that failed or came too late raises

    def actor(self, cls: type, *args: Any, name: str, options: dict | None = None, **kwargs: Any) -> Any: ...
    def get(self, refs: Any, timeout: float | None = None) -> Any: ...
    def wait(self, refs: list, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]: ...
    def kill(self, actor: Any) -> None: ...
    def placement_group(self, bundles: list[dict[str, float]], strategy: str, name: str) -> Any: ...
    def remove_placement_group(self, placement: Any) -> None: ...
    def cluster_resources(self) -> dict[str, float]: ...
    def lost_actor(self, exc: BaseException) -> bool: ...


@dataclass(frozen=True)
class WorkerLaunch:
    """What the job starts its rollout workers with; the fleet starts more of them (rollout.elastic)."""

    model_dir: str
    redis_url: str
    credentials: JobCredentials | None
    run_id: str  # in every worker id: lease owners never collide with a previous run's workers

    def worker_id(self, index: int) -> str:
        return f"w{index}-{self.run_id}"


def worker_resources(cfg: JobConfig) -> dict[str, float]:
    """What one rollout worker reserves: its engine's GPUs (gpus_per_engine) when disaggregated on
    CUDA (colocated engines share the learner's devices), and rollout.resources_per_worker."""
    gpu = cfg.cluster.placement == "disaggregated" and cfg.rollout.device.startswith("cuda")
    return ({"GPU": float(gpus_per_engine(cfg))} if gpu else {}) | cfg.rollout.resources_per_worker


def start_rollout_worker(
    launcher: Launcher,
    cfg: JobConfig,
    launch: WorkerLaunch,
    index: int,
    *,
    paused: bool = False,
    placement: Any = None,
    shared_gpu: tuple[Any, int] | None = None,
) -> Any:
    """Rollout worker ``index`` as an actor of ``launcher`` (on Ray: in ``placement``, a one-bundle
    placement group, if given; or, colocated on GPUs, in bundle b of the learner's placement group
    given as ``shared_gpu`` = (group, b), with GPU_SHARE of that bundle's GPU)."""
    need = worker_resources(cfg)
    # These actors mostly wait on each other; num_cpus=0 keeps a 2-core box schedulable.
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": need.pop("GPU", 0.0), "resources": need or None}
    bundle = 0
    if shared_gpu is not None:
        placement, bundle = shared_gpu
        options["num_gpus"] = GPU_SHARE
    if placement is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # a placement: on Ray

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement, placement_group_bundle_index=bundle
        )
    worker_id = launch.worker_id(index)
    return launcher.actor(
        RolloutWorker,
        cfg,
        launch.model_dir,
        launch.redis_url,
        worker_id,
        index,
        launch.credentials,
        paused,
        name=f"rollout-{worker_id}",
        options=options,
    )
