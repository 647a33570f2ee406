"""The job on Ray (cluster.launcher=ray): its Ray started (with token authentication) or joined,
checked for room, and `RayLauncher`, the seam through which the fleet, the learner group and the
job start and call their actors (slime/launch/local.py is the same seam without Ray).

Ray is imported inside the functions: Ray reads its authentication settings when it is first
imported, and `RaySession.start` sets them just before.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from slime.config import JobConfig
from slime.errors import ClusterError, UserError
from slime.launch.local import machine_resources
from slime.learner.group import check_resources
from slime.security import JobCredentials


class RaySession:
    """The job's Ray: one of its own (cluster.ray_address unset: "local"), or a cluster joined."""

    def __init__(self) -> None:
        self.started = False  # ray.init was called here: close() shuts it down
        self._auth_env: tuple[str, ...] = ()  # environment variables set for the job's own Ray

    def start(self, cfg: JobConfig, credentials: JobCredentials) -> None:
        """Start or join Ray, unless it runs in this process already (a caller's own ray.init)."""
        if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
            # before `import ray`: Ray reads its auth settings when imported
            self._auth_env = ray_token_auth(credentials, cfg.cluster.ray_address)
        import ray  # after its auth settings are in the environment

        if ray.is_initialized():
            return
        address = cfg.cluster.ray_address or "local"
        try:
            ray.init(
                # "local": a Ray of the job's own, even where a cluster runs on this machine (Ray
                # would join that one); "auto" joins it on purpose (a submitted job: slime/tools/submit.py).
                address=address,
                num_cpus=cfg.cluster.num_cpus,
                include_dashboard=False,
                logging_level="warning",
                log_to_driver=True,
                # Ray's GCS keeps an event per actor call, up to 100k by default: ~22 KB a step of its
                # memory for days. The job's own Ray keeps the last 10k (nothing here reads them).
                _system_config={"task_events_max_num_task_in_gcs": 10_000} if address == "local" else None,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ClusterError(f"cluster.ray_address={address}: Ray could not start or join: {first}") from exc
        self.started = True

    def close(self) -> None:
        """Shut down the Ray this session started (after the job's actors are gone); unset its auth."""
        ray = sys.modules.get("ray")
        if self.started and ray is not None:
            ray.shutdown()
        _unset_ray_auth(self._auth_env)


def check_local_resources(cfg: JobConfig) -> None:
    """The Ray this job starts itself has this machine's CPUs and GPUs and no custom resources:
    check the learner against them now (a cluster is checked once connected, LearnerGroup)."""
    ray = sys.modules.get("ray")
    if cfg.cluster.ray_address is not None or (ray is not None and ray.is_initialized()):
        return
    check_resources(cfg, machine_resources(cfg.cluster.num_cpus), "this machine")


def ray_token_auth(credentials: JobCredentials, ray_address: str | None) -> tuple[str, ...]:
    """A local Ray this job starts listens on every interface: with Ray's token authentication
    (the token derived from the job secret, inherited by every Ray process through the
    environment) nobody else can connect to it and run code. An explicit RAY_AUTH_MODE, or an
    existing cluster (cluster.ray_address), is the user's choice. Returns the variables set here."""
    if ray_address is not None or "RAY_AUTH_MODE" in os.environ:
        return ()
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = credentials.token("ray")
    if not _reload_ray_auth():
        _unset_ray_auth(("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"))
        print(
            "warning: Ray was imported before the job started and cannot switch to token "
            "authentication; the job's Ray accepts unauthenticated clients (set RAY_AUTH_MODE)",
            flush=True,
        )
        return ()
    return ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


def _reload_ray_auth() -> bool:
    """Ray reads its auth settings when first imported; an imported Ray must read them again.
    (`ray._raylet`'s loader is Ray's own test hook for this; without it, say so.)"""
    if "ray" not in sys.modules:
        return True
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # Ray is loaded already
    except ImportError:
        return False
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    return True


def _unset_ray_auth(names: tuple[str, ...]) -> None:
    for name in names:
        os.environ.pop(name, None)
    if names:
        _reload_ray_auth()


class RayLauncher:
    """Actors as Ray actors; get, wait and kill are Ray's. Ray must be started (RaySession)."""

    name = "ray"

    def __init__(self) -> None:
        import ray  # see the module docstring

        self._ray = ray
        self.timeout_error: type[BaseException] = ray.exceptions.GetTimeoutError
        self.call_errors: tuple[type[BaseException], ...] = (ray.exceptions.RayError, TimeoutError)

    def actor(self, cls: type, *args: Any, name: str, options: dict | None = None, **kwargs: Any) -> Any:
        return self._ray.remote(**(options or {}))(keeping_user_errors(cls)).remote(*args, **kwargs)

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        return self._ray.get(refs, timeout=timeout)

    def wait(self, refs: list, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        return self._ray.wait(refs, num_returns=num_returns, timeout=timeout)

    def kill(self, actor: Any) -> None:
        self._ray.kill(actor)

    def placement_group(self, bundles: list[dict[str, float]], strategy: str, name: str) -> Any:
        from ray.util.placement_group import placement_group  # with Ray, as above

        return placement_group(bundles, strategy=strategy, name=name)

    def remove_placement_group(self, placement: Any) -> None:
        self._ray.util.remove_placement_group(placement)

    def cluster_resources(self) -> dict[str, float]:
        return self._ray.cluster_resources()

    def lost_actor(self, exc: BaseException) -> bool:
        """A Ray actor died (killed, pre-empted, out of memory): the job may restart from its checkpoint."""
        return isinstance(exc, self._ray.exceptions.RayActorError)


INIT_ERROR = "_slime_init_error"


def keeping_user_errors(cls: type) -> type:
    """``cls`` whose constructor keeps a UserError (a mistake in what the user gave: a plugin that
    does not load, a model directory that is not one) instead of raising it, and whose public
    methods then raise it. Ray reports a constructor's exception as ActorDiedError and keeps only
    its text: the job would take it for a lost actor and restart from its checkpoint, up to
    max_restarts times, over the same mistake. Raised by a method, it reaches the driver as a
    RayTaskError whose cause is the UserError itself, which the CLI prints as one."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            cls.__init__(self, *args, **kwargs)
        except UserError as exc:
            setattr(self, INIT_ERROR, exc)

    namespace: dict[str, Any] = {
        "__init__": __init__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    for attr, method in inspect.getmembers(cls, inspect.isfunction):
        if not attr.startswith("_"):
            namespace[attr] = _raising_init_error(method)
    return type(cls.__name__, (cls,), namespace)


def _raising_init_error(method: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(method):  # Ray makes an async actor of a class with one

        @functools.wraps(method)
        async def call_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            error = self.__dict__.get(INIT_ERROR)
            if error is not None:
                raise error
            return await method(self, *args, **kwargs)

        return call_async

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        error = self.__dict__.get(INIT_ERROR)
        if error is not None:
            raise error
        return method(self, *args, **kwargs)

    return call
