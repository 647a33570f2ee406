"""Shared pytest fixtures: one real redis-server for the whole session, a fresh buffer job per test."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from slime.buffer.redis_server import LocalRedisServer
from slime.buffer.store import TrajectoryStore
from slime.config import ModelConfig, WarmstartConfig
from slime.model import ensure_model_dir
from slime.sample import new_id
from tests.helpers import run_benchmark_smoke, run_slime_chaos

# One at a time: they then fill the core that the in-process tests leave idle (most run on one
# thread, or wait on a timeout), 546 s of them in the first 9 minutes. Two at a time kept both cores
# saturated for 7 minutes, slowed everything beside them, and left the rest of the suite at ~60% CPU:
# 24 min 40 s against 21 min 53 s for the whole suite, the same machine and commit.
SUBPROCESS_CHECKS_AT_ONCE = 1


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


CHAOS_TEST = "test_slime_chaos_on_its_defaults_runs_to_a_clean_audit"


def _reads_a_subprocess_check(item: pytest.Item) -> bool:
    return item.name == CHAOS_TEST or getattr(item, "originalname", None) == "test_benchmark_smoke"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that read a subprocess check's result run last (in their order), so the checks,
    started with the session, run beside the whole suite instead of holding it up."""
    items.sort(key=_reads_a_subprocess_check)


def _selected_subprocess_checks(items: list[pytest.Item]) -> dict[str, Callable[[], tuple]]:
    """The long subprocess runs of the selected, unskipped tests: `slime chaos` (the longest, first)
    and each benchmark's `--smoke` (tests/test_benchmarks.py)."""
    checks: dict[str, Callable[[], tuple]] = {}
    for item in items:
        if not _reads_a_subprocess_check(item):
            continue
        if any(m.name == "skipif" and m.args and m.args[0] for m in item.iter_markers()):
            continue
        if item.name == CHAOS_TEST:
            checks = {"chaos": run_slime_chaos, **checks}
        else:
            name = item.callspec.params["name"]
            checks[f"smoke:{name}"] = lambda name=name: run_benchmark_smoke(name)
    return checks


@pytest.fixture(scope="session", autouse=True)
def subprocess_checks(request: pytest.FixtureRequest) -> Iterator[dict[str, Future]]:
    """The selected tests' long subprocess runs, started with the session's first test,
    SUBPROCESS_CHECKS_AT_ONCE at a time, beside the rest of the suite. They spend much of their
    time starting Python, Ray or a redis-server, or waiting out a fault's timeout, so on two cores
    they overlap the in-process tests well (the suite's time: README). A test reads its run's
    future: (CompletedProcess, wall seconds)."""
    pool = ThreadPoolExecutor(SUBPROCESS_CHECKS_AT_ONCE, thread_name_prefix="subprocess-check")
    try:
        yield {key: pool.submit(run) for key, run in _selected_subprocess_checks(request.session.items).items()}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a session cut short starts no further check


@pytest.fixture
def slime_main(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., subprocess.CompletedProcess]:
    """The `slime` command's main() in this process, answering as a `slime` subprocess would: its exit
    code and what it printed. A subprocess spends ~6 s importing torch, transformers and Ray before the first
    check; the errors a real process prints (exit code, no traceback, --debug's traceback) are
    checked in real processes in tests/test_cli_errors.py."""
    from slime.cli import main

    def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
        said = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, said.out, said.err)

    return run
