"""Shared pytest fixtures: one real redis-server for the whole session, a fresh buffer job per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from slime.buffer import RedisBuffer
from slime.redis_server import LocalRedisServer
from slime.sample import new_id


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # No AOF here: tests that check durability start their own server with aof=True.
    server = LocalRedisServer(tmp_path_factory.mktemp("redis"), aof=False)
    yield server.url
    server.stop()


@pytest.fixture
def buffer(redis_url: str) -> Iterator[RedisBuffer]:
    """A RedisBuffer on a job name of its own; every key of that job is deleted afterwards."""
    buf = RedisBuffer(redis_url, job=f"test-{new_id()}")
    yield buf
    buf.delete_job()
    buf.close()
