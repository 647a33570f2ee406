"""Shared pytest fixtures: one real redis-server for the whole session, a fresh buffer job per test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from slime.buffer.redis_server import LocalRedisServer
from slime.buffer.store import TrajectoryStore
from slime.config import ModelConfig, WarmstartConfig
from slime.model import ensure_model_dir
from slime.sample import new_id


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # No AOF here: tests that check durability start their own server with aof=True.
    server = LocalRedisServer(tmp_path_factory.mktemp("redis"), aof=False)
    yield server.url
    server.stop()


@pytest.fixture
def buffer(redis_url: str) -> Iterator[TrajectoryStore]:
    """A TrajectoryStore on a job name of its own; every key of that job is deleted afterwards."""
    buf = TrajectoryStore.open(redis_url, f"test-{new_id()}")
    yield buf
    buf.delete_job()
    buf.close()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a test module (engine tests: robust on a shared 2-core machine)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The default tiny MoE with a short warm-start, built once per session (as a job would)."""
    cfg = ModelConfig(cache_dir=str(tmp_path_factory.mktemp("models")), warmstart=WarmstartConfig(steps=40))
    return ensure_model_dir(cfg)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the tests that need actors (starting Ray costs seconds)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray  # late: Ray reads RAY_AUTH_MODE when it is imported

    # "local": a Ray of the tests' own, never a cluster some other process runs on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    yield
    ray.shutdown()
