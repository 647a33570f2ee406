"""Reward service modes (rewards/service.py, rewards/server.py): a real HTTP server answering a real
HTTP client, the Ray actor mode, retry with backoff, the result cache, garbage failing only its own
samples, and a PRM's step rewards stored on the right tokens by a real rollout worker."""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rewards.runner import RewardRunner
from rewards.server import ServerThread, make_app, read_spec
from rewards.service import CachedRewards, RemoteRewardClient, http_transport, make_reward_service
from slime.config import ConfigError, RewardConfig, load_config
from tests.helpers import wait_for

TOKEN = "reward-service-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

REWARDS_PY = """
import math, time

CALLS = {"n": 0}

def overlap(prompt, response, label=None):
    CALLS["n"] += 1
    return sum(a == b for a, b in zip(response, label or "")) / max(len(label or ""), 1)

def garbage(prompt, response, label=None):
    if response == "nan":
        return math.nan
    if response == "text":
        return "seven"
    if response == "boom":
        raise RuntimeError("reward crashed on purpose")
    if response == "hang":
        time.sleep(5)
    if response == "steps":
        return {"score": 1.0, "step_scores": [0.5], "step_ends": [99]}
    return 1.0
"""


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return path


def _results(service, items):
    futures = [service.submit(p, r, label) for p, r, label in items]
    return [f.result(timeout=30) for f in futures]


GARBAGE_ITEMS = [
    ("q", "fine", None),
    ("q", "nan", None),
    ("q", "text", None),
    ("q", "boom", None),
    ("q", "hang", None),
    ("q", "steps", None),
    ("q", "also fine", None),
]


def _check_garbage(results) -> None:
    by = {item[1]: r for item, r in zip(GARBAGE_ITEMS, results)}
    assert by["fine"].reward == 1.0 and by["also fine"].reward == 1.0
    assert by["nan"].reward is None and "nan, not a finite number" in by["nan"].failure
    assert "returned str 'seven', not a number" in by["text"].failure
    assert "RuntimeError: reward crashed on purpose" in by["boom"].failure
    assert "timed out after 0.5s" in by["hang"].failure
    assert "step_ends[0] = 99 is not a character index" in by["steps"].failure


# ----------------------------------------------------------------------------- HTTP


def test_http_service_answers_a_real_http_client(rewards_file):
    runner = RewardRunner(_load(f"{rewards_file}:overlap"), timeout_s=5, max_concurrency=2)
    with ServerThread(make_app(runner, token=TOKEN)) as server:
        reply = httpx.post(
            f"{server.url}/score",
            json={
                "samples": [
                    {"prompt": "ab*2=", "response": "abab", "label": "abab"},
                    {"prompt": "ab*2=", "response": "abxx", "label": "abab", "metadata": {"task": "repeat"}},
                ]
            },
            headers=AUTH,
            timeout=10,
        )
        assert reply.status_code == 200
        results = reply.json()["results"]
        assert [r["reward"] for r in results] == [1.0, 0.5] and all(r.get("failure") is None for r in results)
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        assert health["status"] == "ok" and health["scored"] == 2 and health["failed"] == 0
        # A malformed request is refused by the schema, naming the field.
        bad = httpx.post(f"{server.url}/score", json={"samples": [{"prompt": "x"}]}, headers=AUTH, timeout=10)
        assert bad.status_code == 422 and "response" in bad.text
    runner.close()


def test_http_mode_from_config_with_cache(rewards_file):
    runner = RewardRunner(_load(f"{rewards_file}:overlap"), timeout_s=5, max_concurrency=2)
    with ServerThread(make_app(runner, token=TOKEN)) as server:
        service = make_reward_service(RewardConfig(mode="http", url=server.url, cache_size=16, token=TOKEN), "t")
        assert isinstance(service, CachedRewards)
        items = [("p", "abab", "abab"), ("p", "abxx", "abab"), ("p", "abab", "abab")]
        first = _results(service, items)
        assert [r.reward for r in first] == [1.0, 0.5, 1.0]
        scored_before = httpx.get(f"{server.url}/health").json()["scored"]
        again = _results(service, items[:2])
        assert [r.reward for r in again] == [1.0, 0.5]
        assert httpx.get(f"{server.url}/health").json()["scored"] == scored_before  # served from the cache
        assert service.hits >= 2
        # A different label is a different key.
        assert _results(service, [("p", "abab", "xxxx")])[0].reward == 0.0
        service.close()
    runner.close()


def test_garbage_fails_only_its_samples_in_process_and_over_http(rewards_file):
    in_process = make_reward_service(
        RewardConfig(fn=f"{rewards_file}:garbage", timeout_s=0.5, max_concurrency=8, cache_size=0), "t"
    )
    _check_garbage(_results(in_process, GARBAGE_ITEMS))
    in_process.close()

    runner = RewardRunner(_load(f"{rewards_file}:garbage"), timeout_s=0.5, max_concurrency=8)
    with ServerThread(make_app(runner, token=TOKEN)) as server:
        remote = make_reward_service(
            RewardConfig(mode="http", url=server.url, timeout_s=0.5, cache_size=0, token=TOKEN), "t"
        )
        _check_garbage(_results(remote, GARBAGE_ITEMS))
        remote.close()
    runner.close()


def test_garbage_replies_from_a_foreign_server():
    """A server that is not ours: NaN, a string, a missing field fail one sample each; a wrong count
    fails the batch, naming the counts."""
    app = FastAPI()

    @app.post("/score")
    async def score(request: Request) -> Response:
        samples = (await request.json())["samples"]
        if samples[0]["response"] == "extra":
            return JSONResponse({"results": [{"reward": 1.0}] * (len(samples) + 1)})
        replies = {
            "ok": '{"reward": 0.25}',
            "nan": '{"reward": NaN}',
            "str": '{"reward": "high"}',
            "none": '{"latency_s": 1}',
            "list": "[1, 2]",
        }
        body = '{"results": [' + ", ".join(replies[s["response"]] for s in samples) + "]}"
        return Response(body, media_type="application/json")

    with ServerThread(app) as server:
        client = _client(server.url, batch_size=8)
        r = _results(client, [("p", x, None) for x in ("ok", "nan", "str", "none", "list")])
        assert r[0].reward == 0.25
        assert "nan, not a finite number" in r[1].failure
        assert "returned str 'high', not a number" in r[2].failure
        assert "without 'reward' or 'failure'" in r[3].failure
        assert "not an object" in r[4].failure
        wrong = _results(client, [("p", "extra", None), ("p", "extra", None)])
        assert all(re.search(r"answered (\d) results for (\d) samples", w.failure) for w in wrong)
        client.close()


def test_the_http_client_keeps_the_response_token_ids_home():
    """At long lengths the token ids alone would pass a reward server's body limit: not sent."""
    seen: list[dict] = []
    app = FastAPI()

    @app.post("/score")
    async def score(request: Request) -> Response:
        samples = (await request.json())["samples"]
        seen.extend(s["metadata"] for s in samples)
        return JSONResponse({"results": [{"reward": 1.0} for _ in samples]})

    with ServerThread(app) as server:
        client = _client(server.url)
        result = client.submit("p", "r", None, {"model_prompt": "<u>p", "response_ids": list(range(5000))}).result(30)
        client.close()
    assert result.reward == 1.0 and seen == [{"model_prompt": "<u>p"}]


def test_retry_with_exponential_backoff_then_success():
    calls: list[float] = []
    app = FastAPI()

    @app.post("/score")
    async def score(request: Request) -> Response:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            return JSONResponse({"detail": "warming up"}, status_code=503)
        return JSONResponse({"results": [{"reward": 0.5} for _ in (await request.json())["samples"]]})

    with ServerThread(app) as server:
        client = _client(server.url, backoff_s=0.2, max_retries=3)
        result = client.submit("p", "r").result(timeout=30)
        assert result.reward == 0.5, result.failure
        assert client.attempts == 3 and client.retries == 2
        gaps = np.diff(calls)
        assert gaps[0] >= 0.2 * 0.8 and gaps[1] >= 0.4 * 0.8  # 0.2 s, then doubled (±20% jitter)
        client.close()


def test_unreachable_and_slow_servers_fail_after_retries():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    client = _client(f"http://127.0.0.1:{dead_port}", backoff_s=0.05, max_retries=2)
    r = client.submit("p", "r").result(timeout=30)
    assert r.failure is not None and "failed after 3 attempts" in r.failure and "ConnectError" in r.failure
    client.close()

    app = FastAPI()

    @app.post("/score")
    async def score() -> dict:
        await asyncio.sleep(1.5)
        return {"results": [{"reward": 1.0}]}

    with ServerThread(app) as server:
        client = _client(server.url, backoff_s=0.05, max_retries=1, request_timeout_s=0.3)
        started = time.monotonic()
        r = client.submit("p", "r").result(timeout=30)
        assert "failed after 2 attempts" in r.failure and "timed out after 0.3s" in r.failure
        assert time.monotonic() - started < 3
        client.close()


# ----------------------------------------------------------------------------- cache, config


def test_cache_is_bounded_lru_and_skips_failures(rewards_file):
    counter = _load(f"{rewards_file}:overlap").__globals__["CALLS"]
    cache = CachedRewards(RewardRunner(_load(f"{rewards_file}:overlap"), 5, 2), max_entries=2)
    base = counter["n"]
    for resp in ("a", "b", "a", "c", "a", "b"):  # b is evicted by c (a was used more recently)
        cache.submit("p", resp, "a").result(timeout=10)
    assert counter["n"] - base == 4 and cache.hits == 2 and len(cache) == 2
    failing = CachedRewards(RewardRunner(lambda prompt, response: math.nan, 5, 1), max_entries=4)
    assert failing.submit("p", "r").result().failure and failing.submit("p", "r").result().failure
    assert failing.hits == 0 and len(failing) == 0
    cache.close()
    failing.close()


def test_config_rules_name_the_field():
    with pytest.raises(ConfigError, match="reward.url is required when reward.mode is 'http'"):
        load_config(None, ["reward.mode=http"])
    with pytest.raises(ConfigError, match="reward.mode=http to use it"):
        load_config(None, ["reward.url=http://127.0.0.1:1"])
    assert load_config(None, ["reward.mode=ray_actor"]).reward.mode == "ray_actor"


def test_read_spec_from_yaml(tmp_path):
    (tmp_path / "r.yaml").write_text("mix:\n  - {fn: rewards.rule:exact_match, weight: 1.0}\n")
    assert read_spec(str(tmp_path / "r.yaml")) == {"mix": [{"fn": "rewards.rule:exact_match", "weight": 1.0}]}
    assert read_spec("rewards.rule:exact_match") == "rewards.rule:exact_match"


# ----------------------------------------------------------------------------- Ray actor


def test_ray_actor_mode(ray_session, rewards_file):
    import ray

    cfg = RewardConfig(mode="ray_actor", fn=f"{rewards_file}:garbage", timeout_s=0.5, max_concurrency=8, cache_size=0)
    service = make_reward_service(cfg, "actor-test")
    _check_garbage(_results(service, GARBAGE_ITEMS))
    actor = ray.get_actor("slime-reward-actor-test")
    assert ray.get(actor.health.remote())["status"] == "ok"
    # A second worker of the same job reuses the actor instead of starting another.
    other = make_reward_service(cfg, "actor-test")
    assert other.submit("p", "fine").result(timeout=30).reward == 1.0
    service.close()
    other.close()
    ray.kill(actor)


def test_a_crashed_reward_actor_is_restarted_and_its_samples_retried(ray_session, tmp_path):
    """The reward actor's process dies in the middle of a batch (here: killed, once, as the kernel's
    OOM killer or a segfault would; an os._exit in a reward only fails its call, rewards/exit_guard.py).
    Ray restarts the actor (max_restarts=3), the client retries the batch with backoff, and every
    sample gets its reward; none is lost or failed."""
    import ray

    marker = tmp_path / "crashed-once"
    reward_file = tmp_path / "crash_once.py"
    reward_file.write_text(
        "import os, signal\n"
        "def reward(prompt, response, label=None):\n"
        f"    if not os.path.exists({str(marker)!r}):\n"
        f"        open({str(marker)!r}, 'w').close()\n"
        "        os.kill(os.getpid(), signal.SIGKILL)  # the actor's whole process, mid-batch\n"
        "    return float(len(response))\n"
    )
    cfg = RewardConfig(mode="ray_actor", fn=f"{reward_file}:reward", max_retries=3, backoff_s=0.2, cache_size=0)
    service = make_reward_service(cfg, "actor-crash")
    try:
        results = [f.result(timeout=120) for f in [service.submit("p", "x" * n) for n in range(1, 6)]]
        assert marker.exists()  # it did crash
        assert [(r.reward, r.failure) for r in results] == [(float(n), None) for n in range(1, 6)]
    finally:
        service.close()
        ray.kill(ray.get_actor("slime-reward-actor-crash"))


def test_a_hung_reward_actor_is_killed_restarted_and_its_samples_retried(ray_session, tmp_path):
    """The reward actor's process stops answering (SIGSTOP: a deadlock or a blocked event loop
    looks the same). A call times out, the actor does not answer a health probe either, so the
    client kills it, Ray restarts it, and the retried batch gets every reward."""
    import ray

    reward_file = tmp_path / "length.py"
    reward_file.write_text("def reward(prompt, response, label=None):\n    return float(len(response))\n")
    cfg = RewardConfig(
        mode="ray_actor", fn=f"{reward_file}:reward", request_timeout_s=3, max_retries=3, backoff_s=0.2, cache_size=0
    )
    service = make_reward_service(cfg, "actor-hang")
    actor = ray.get_actor("slime-reward-actor-hang")
    try:
        assert service.submit("p", "xy").result(timeout=60).reward == 2.0
        hung_pid = ray.get(actor.health.remote())["pid"]
        os.kill(hung_pid, signal.SIGSTOP)
        results = [f.result(timeout=120) for f in [service.submit("p", "x" * n) for n in range(1, 6)]]
        assert [(r.reward, r.failure) for r in results] == [(float(n), None) for n in range(1, 6)]
        assert ray.get(actor.health.remote())["pid"] != hung_pid and service.retries >= 1
    finally:
        service.close()
        ray.kill(actor)
        try:
            os.kill(hung_pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


# ----------------------------------------------------------------------------- PRM -> tokens


@pytest.mark.slow
def test_prm_step_rewards_land_on_step_end_tokens_in_the_stored_sample(tiny_model_dir, redis_url, tmp_path):
    from rewards.prm import ProcessRewardModel
    from slime.buffer import TrajectoryStore
    from slime.data import _chat_ids
    from slime.model import load_tokenizer
    from slime.rollout import RolloutWorker
    from slime.sample import Status

    ProcessRewardModel.from_backbone(tiny_model_dir, delimiter="b").save(tmp_path / "prm")
    job = "prm-tokens"
    cfg = load_config(
        None,
        [
            f"job_name={job}",
            f"output_dir={tmp_path}",
            "rollout.max_new_tokens=12",
            "rollout.temperature=0",
            "rollout.ignore_eos=true",
        ],
    )
    cfg.reward.fn = {
        "fn": "rewards.prm:prm_reward",
        "kwargs": {"model_dir": str(tmp_path / "prm"), "aggregation": "mean", "token_level": True},
    }
    buffer = TrajectoryStore.open(redis_url, job)
    buffer.delete_job()
    tok = load_tokenizer(tiny_model_dir)
    prompt_ids = _chat_ids("ab*3=", [{"role": "user", "content": "ab*3="}], tok)
    gid = buffer.add_group(prompt_ids, 1, 12, {"label": "ababab", "prompt_text": "ab*3="})
    worker = RolloutWorker(cfg, str(tiny_model_dir), redis_url, "w0")
    try:
        wait_for(lambda: buffer.counts()["groups_ready"] == 1, 120, "the sample to be generated and scored")
    finally:
        worker.stop()
    sample = buffer.get_group(gid)[0]
    assert sample.status == Status.TRUNCATED, sample.failure
    chars = [tok.decode([t], skip_special_tokens=True) for t in sample.response_ids.tolist()]
    assert all(len(c) <= 1 for c in chars)  # the char tokenizer: one character per token
    text = "".join(chars)
    # Independently: a step ends on a non-delimiter character followed by the delimiter or the end.
    ends = [i for i, c in enumerate(chars) if c and c != "b" and (i + 1 == len(chars) or chars[i + 1] == "b")]
    assert ends, f"no step in {text!r}"
    prm = ProcessRewardModel.load(tmp_path / "prm")
    scores = prm.step_scores(["ab*3="], [text])[0]
    assert len(scores) == len(ends)
    assert sample.token_rewards is not None and sample.token_rewards.shape == (sample.response_length,)
    assert np.flatnonzero(sample.token_rewards).tolist() == ends
    np.testing.assert_allclose(sample.token_rewards[ends], scores, rtol=1e-5)
    assert math.isclose(sample.reward, sum(scores) / len(scores), rel_tol=1e-5)
    buffer.delete_job()


def test_learner_batch_marks_rows_with_token_rewards():
    """PPO/GAE uses a row's token rewards alone when it has them (the PRM's aggregate stays for
    GRPO and the metrics): collate marks those rows."""
    from slime.learner import collate
    from slime.sample import Sample, Status

    rows = []
    for token_rewards in (np.array([0.0, 0.7, 0.0], np.float32), None):
        s = Sample("g", 0, [1, 2], 8, status=Status.COMPLETED, reward=0.7, token_rewards=token_rewards)
        s.append([3, 4, 5], [-1.0, -1.0, -1.0], 0)
        rows.append(s)
    batch = collate(rows, [0, 0], pad_id=0)
    assert batch.token_reward_rows.tolist() == [True, False]
    assert batch.token_rewards[0].tolist() == pytest.approx([0.0, 0.7, 0.0]) and batch.token_rewards[1].abs().sum() == 0
    assert batch.scores.tolist() == pytest.approx([0.7, 0.7])
    assert collate(rows[1:], [0], pad_id=0).token_reward_rows is None


# ----------------------------------------------------------------------------- helpers


def _load(spec: str):
    from rewards.plugin import load_function

    return load_function(spec)


def _client(
    url: str, batch_size: int = 4, backoff_s: float = 0.05, max_retries: int = 3, request_timeout_s: float = 10.0
) -> RemoteRewardClient:
    make, close = http_transport(url)
    return RemoteRewardClient(
        url, make, request_timeout_s, 2, batch_size, max_retries, backoff_s, close_transport=close
    )


def test_a_reply_too_large_fails_its_batch_before_it_fills_the_workers_memory(monkeypatch):
    """The client read whole replies: a hostile or broken reward server could make a worker hold
    any amount. Past MAX_REPLY_BYTES the batch fails, not retried."""
    from rewards import service

    monkeypatch.setattr(service, "MAX_REPLY_BYTES", 1 << 20)
    app = FastAPI()

    @app.post("/score")
    async def score() -> Response:
        return Response(b"[" + b"0," * (2 << 20) + b"0]", media_type="application/json")

    with ServerThread(app) as server:
        client = _client(server.url, max_retries=2)
        r = client.submit("p", "r").result(timeout=30)
        assert r.failure is not None and "the reply is over 1 MiB for 1 samples" in r.failure, r.failure
        assert client.attempts == 1
        client.close()


# A reply that would clear the terminal, retitle it, ring its bell and forge a log line of its own.
HOSTILE_TEXT = "\x1b[2J\x1b]0;owned\x07\n2024-01-01 12:00:00 INFO slime: all rewards verified\r\x9b31m\x7f\u2028"


def test_a_servers_own_text_reaches_failures_and_logs_escaped(caplog):
    """A reward server's error body, a reply that is not JSON and a sample's failure reason go into
    failure reasons, log lines and the terminal: shown with their control characters and line breaks
    escaped, and capped."""
    app = FastAPI()

    @app.post("/score")
    async def score(request: Request) -> Response:
        how = (await request.json())["samples"][0]["response"]
        if how == "503":
            return Response(HOSTILE_TEXT, status_code=503, media_type="text/plain")
        if how == "400":
            return Response(HOSTILE_TEXT * 1000, status_code=400, media_type="text/plain")
        if how == "not json":
            return Response(HOSTILE_TEXT, media_type="application/json")
        return JSONResponse({"results": [{"reward": None, "failure": HOSTILE_TEXT * 1000}]})

    with ServerThread(app) as server, caplog.at_level("WARNING", logger="rewards.service"):
        client = _client(server.url, batch_size=1, max_retries=1)
        failures = {
            how: client.submit("p", how).result(timeout=30).failure for how in ("503", "400", "not json", "own")
        }
        client.close()
    assert "HTTP 503" in failures["503"] and "HTTP 400" in failures["400"] and "not JSON" in failures["not json"]
    logged = [record.getMessage() for record in caplog.records]
    assert any("HTTP 503" in line for line in logged)  # the retried attempt's warning
    for text in [*failures.values(), *logged]:
        assert text.isprintable(), repr(text)  # no escape code, no line break
    for failure in failures.values():
        assert "\\x1b[2J\\x1b]0;owned\\x07\\n2024-01-01" in failure and len(failure) < 2500  # visible, capped
