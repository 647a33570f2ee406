"""Shared test helpers that need no downloads."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from slime.model import CHAT_TEMPLATE, build_char_tokenizer

# A whole APRIL job small enough for a test: 3 groups of 3 per step, 48 tokens, APRIL x2.
APRIL_SMALL_JOB = [
    "rollout.batch_size=3",
    "rollout.n_samples_per_prompt=3",
    "rollout.max_new_tokens=48",
    "data.num_generated=64",
    "logging.progress=false",
    "april.enabled=true",
    "april.oversample=2.0",
]


# The smallest whole job the end-to-end tests run: 2 groups of 2 samples a step, quiet output.
TINY_JOB = [
    "rollout.batch_size=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_new_tokens=24",
    "data.num_generated=32",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plot=false",
]


def needs(available: bool, reason: str) -> pytest.MarkDecorator:
    """skipif for a system tool a developer's machine may lack (bubblewrap, Chromium). In CI
    (.ci/run sets SLIME_CI=1) a missing tool fails the run at collection instead of skipping."""
    if not available and os.environ.get("SLIME_CI") == "1":
        raise RuntimeError(f"SLIME_CI=1 and a test's system tool is missing: {reason}")
    return pytest.mark.skipif(not available, reason=reason)


def make_char_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """The project's character-level tokenizer (ids 0..5 are the special tokens)."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = chat_template
    return tokenizer


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll until predicate() is truthy; its value, or an AssertionError naming what never happened."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def drive_engine(engine, reqs, until=None, timeout=60.0) -> dict[str, dict]:
    """Drive the engine like the rollout worker; collect tokens, logprobs, finish reason per id."""
    for r in reqs:
        engine.add_request(r)
    out = {r.request_id: {"tokens": [], "logprobs": [], "reason": None} for r in reqs}
    deadline = time.time() + timeout
    while engine.has_unfinished():
        assert time.time() < deadline, "generation did not finish"
        for c in engine.step():
            o = out[c.request_id]
            o["tokens"] += c.token_ids
            o["logprobs"] += c.logprobs
            o["reason"] = c.finish_reason
        if until is not None and until(out):
            break
    return out


REPO = Path(__file__).resolve().parents[1]
SMOKE_TIMEOUT_S = 400  # the slowest smoke takes about half a minute alone on 2 cores, longer beside others


def run_benchmark_smoke(name: str) -> tuple[subprocess.CompletedProcess, float]:
    """`python benchmarks/NAME.py --smoke`: the finished process and its wall seconds."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    return proc, time.monotonic() - started


def run_slime_chaos() -> tuple[subprocess.CompletedProcess, float]:
    """`slime chaos` with no arguments, as a new user types it, in a fresh working directory."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="slime-chaos-test-") as cwd:
        proc = subprocess.run(
            [sys.executable, "-m", "slime.cli", "chaos"],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    return proc, time.monotonic() - started


def routers_choices(model: Any, ids: list[int]) -> Any:
    """[positions, layers * k]: the experts the model's own routers choose over ``ids`` (one forward)."""
    import torch

    from slime.engines.routing import routers_of

    captured = []
    hooks = [r.register_forward_hook(lambda m, i, out: captured.append(out[-1])) for r in routers_of(model)]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return torch.cat(captured, dim=1)  # each [positions, k], in layer order


def run_until_still_running(script: Path, source: str) -> subprocess.CompletedProcess:
    """Run `source` as a Python script with the repository importable; it must exit 0 with its last
    line "still running" (what an exit-guard test prints once every exit it provoked was caught)."""
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("still running"), done.stdout + done.stderr
    return done
