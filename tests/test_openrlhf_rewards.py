"""OpenRLHF's rewards, used unchanged: a remote reward model speaking its wire format
(`reward.http_format=openrlhf`, what `--remote_rm_url` and `openrlhf.cli.serve_rm` speak) and a
`reward_func(queries, prompts, labels)` file. Real HTTP servers, a real rollout worker."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rewards.adapters import detect_style, load_reward, openrlhf_results
from rewards.runner import RewardRunner
from rewards.server import ServerThread
from rewards.service import make_reward_service
from slime.config import ConfigError, RewardConfig, load_config
from tests.helpers import wait_for


def _openrlhf_server(seen: list[dict]) -> FastAPI:
    """What `openrlhf.cli.serve_rm` answers (rewards, scores, extra_logs), scoring each query by its
    share of 'a'; a few responses answer as broken servers do."""
    app = FastAPI()

    @app.post("/get_reward")
    async def get_reward(request: Request) -> Response:
        data = await request.json()
        seen.append(data)
        queries = data["query"]
        if queries[0].endswith("no-rewards"):
            return JSONResponse({"scores": [1.0] * len(queries)})
        if queries[0].endswith("short"):
            return JSONResponse({"rewards": [1.0] * (len(queries) - 1)})
        rewards = [None if q.endswith("none") else _share_of_a(q) for q in queries]
        return JSONResponse(
            {"rewards": rewards, "scores": rewards, "extra_logs": {"length": [len(q) for q in queries]}}
        )

    return app


def _share_of_a(text: str) -> float:
    return text.count("a") / max(len(text), 1)


def _score(service, items: list[tuple[str, str, str, dict]]) -> list:
    futures = [service.submit(p, r, label, meta) for p, r, label, meta in items]
    return [f.result(timeout=30) for f in futures]


def _score_on_server(batches: list[list[tuple[str, str, str | None, dict]]], **config) -> tuple[list, list[dict]]:
    """Each batch's results from an OpenRLHF-style server (one service, reward.http_format=openrlhf),
    and the requests the server saw."""
    seen: list[dict] = []
    with ServerThread(_openrlhf_server(seen)) as server:
        cfg = RewardConfig(mode="http", url=server.url + "/get_reward", http_format="openrlhf", batch_size=8, **config)
        service = make_reward_service(cfg, "openrlhf-wire")
        try:
            return [_score(service, batch) for batch in batches], seen
        finally:
            service.close()


def test_an_openrlhf_reward_server_scores_over_its_own_wire_format():
    meta = {"model_prompt": "<user>ab</user>"}
    (results,), seen = _score_on_server(
        [[("ab", "aab", "x", meta), ("ab", "bbbb", "y", meta), ("ab", "none", "z", meta)]], cache_size=0
    )
    assert [r.reward for r in results[:2]] == [_share_of_a("<user>ab</user>aab"), _share_of_a("<user>ab</user>bbbb")]
    assert results[0].info == {"length": len("<user>ab</user>aab")}
    # a null reward fails its own sample only, naming the server
    assert results[2].reward is None and "returned None" in results[2].failure
    request = seen[0]
    # OpenRLHF's query is the text the model read (chat template applied) followed by the response
    assert request["query"][0] == "<user>ab</user>aab"
    # and its prompts are that prompt, so that query[len(prompt):] is the response
    assert request["prompts"][:2] == ["<user>ab</user>"] * 2 and request["labels"][:2] == ["x", "y"]


def test_a_broken_openrlhf_reply_fails_its_batch_with_the_reason():
    (missing, short), _ = _score_on_server(
        [[("p", "no-rewards", None, {}), ("p", "b", None, {})], [("p", "short", None, {}), ("p", "c", None, {})]],
        max_retries=0,
    )
    for r in missing:
        assert r.reward is None and "answered without 'rewards' (keys: ['scores'])" in r.failure, r.failure
    # The server answers a batch that starts with "short" one reward short. The client batches what is
    # pending when it sends: "short" and "c" go together (1 reward for 2) or "short" alone (0 for 1).
    said = re.search(r"gave (\d+) rewards for (\d+) queries", short[0].failure or "")
    assert short[0].reward is None and said and int(said[1]) == int(said[2]) - 1, short[0].failure
    assert short[1].failure == short[0].failure if said[2] == "2" else short[1].reward is not None


def test_http_format_belongs_to_http_mode():
    with pytest.raises(ConfigError, match="reward.http_format=openrlhf applies to reward.mode=http"):
        load_config(None, ["reward.http_format=openrlhf"])
    with pytest.raises(ConfigError, match="http_format"):
        load_config(None, ["reward.mode=http", "reward.url=http://127.0.0.1:1/x", "reward.http_format=verl"])


REWARD_FUNC_PY = """
import torch

def reward_func(queries, prompts, labels, **kwargs):
    rewards = torch.tensor([float(q.endswith(l)) for q, l in zip(queries, labels)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"accuracy": rewards.mean(), "query": list(queries)}}

def bare(queries, prompts, labels):
    return [len(q) for q in queries]

def two(queries, prompts, labels):
    return {"rewards": [1.0, 0.0]}

def no_rewards(queries, prompts, labels):
    return {"score": 1.0}
"""


def test_an_openrlhf_reward_func_file_loads_unchanged(tmp_path: Path):
    path = tmp_path / "reward_func.py"
    path.write_text(REWARD_FUNC_PY)
    fn = load_reward(f"{path}:reward_func")
    assert detect_style(fn.__wrapped_reward__) == "openrlhf"
    runner = RewardRunner(fn, timeout_s=10, max_concurrency=2, name="reward_func")
    meta = {"model_prompt": "[Q] 2+2? [A] "}
    right, wrong = _score(runner, [("2+2?", "4", "4", meta), ("2+2?", "5", "4", meta)])
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    # extra_logs: a per-query list gives each query its own value, a scalar tensor is given to every one
    assert right.info == {"accuracy": 1.0, "query": "[Q] 2+2? [A] 4"}
    (bare,) = _score(RewardRunner(load_reward(f"{path}:bare"), 10, 1), [("p", "abc", None, {})])
    assert bare.reward == 4.0  # no model_prompt: the prompt, then the response
    (two,) = _score(RewardRunner(load_reward(f"{path}:two"), 10, 1), [("p", "r", None, {})])
    assert two.reward is None and "gave 2 rewards for 1 queries" in two.failure
    (none,) = _score(RewardRunner(load_reward(f"{path}:no_rewards"), 10, 1), [("p", "r", None, {})])
    assert none.reward is None and "without 'rewards' (keys: ['score'])" in none.failure


def test_openrlhf_results_reads_lists_tensors_and_bare_replies():
    import torch

    assert openrlhf_results({"rewards": torch.tensor([0.5, 1.0])}, 2, "w") == [{"score": 0.5}, {"score": 1.0}]
    assert openrlhf_results(np.array([2.0]), 1, "w") == [{"score": 2.0}]
    with pytest.raises(TypeError, match="gave rewards as str"):
        openrlhf_results({"rewards": "high"}, 1, "w")


def test_a_rollout_worker_scores_with_an_openrlhf_reward_server(tiny_model_dir, redis_url, tmp_path):
    """The worker sends OpenRLHF's query, the chat-templated prompt the model read and its response,
    and stores the server's reward and extra_logs."""
    from slime.buffer import TrajectoryStore
    from slime.data import _chat_ids
    from slime.model import load_tokenizer
    from slime.rollout import RolloutWorker
    from slime.sample import Status

    seen: list[dict] = []
    job = "openrlhf-worker"
    tok = load_tokenizer(tiny_model_dir)
    prompt_ids = _chat_ids("ab*3=", [{"role": "user", "content": "ab*3="}], tok)
    with ServerThread(_openrlhf_server(seen)) as server:
        cfg = load_config(
            None,
            [
                f"job_name={job}",
                f"output_dir={tmp_path}",
                "rollout.max_new_tokens=8",
                "reward.mode=http",
                f"reward.url={server.url}/get_reward",
                "reward.http_format=openrlhf",
            ],
        )
        buffer = TrajectoryStore.open(redis_url, job)
        buffer.delete_job()
        gid = buffer.add_group(prompt_ids, 2, 8, {"label": "ababab", "prompt_text": "ab*3="})
        worker = RolloutWorker(cfg, str(tiny_model_dir), redis_url, "w0")
        try:
            wait_for(lambda: buffer.counts()["groups_ready"] == 1, 120, "the samples to be generated and scored")
        finally:
            worker.stop()
    templated = tok.decode(prompt_ids, skip_special_tokens=False)
    assert templated != "ab*3="  # the chat template is in what the model read
    queries = [q for request in seen for q in request["query"]]
    for sample in buffer.get_group(gid):
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED), sample.failure
        # as OpenRLHF decodes it: special tokens and the stop token kept (a reward model scores there)
        query = templated + tok.decode(sample.response_ids.tolist(), skip_special_tokens=False)
        assert query in queries, (query, queries)
        assert sample.reward == pytest.approx(_share_of_a(query))
        assert sample.metadata["reward_info"] == {"length": len(query)}
    assert all(request["prompts"] and set(request["prompts"]) == {templated} for request in seen)
    assert json.dumps(seen)  # what went over the wire is plain JSON
    buffer.delete_job()


def test_openrlhf_replies_as_openrlhf_reads_them():
    import torch

    # one query, one number (OpenRLHF wraps it in a tensor itself); extra_logs tensors as plain values
    assert openrlhf_results({"rewards": torch.tensor(0.5), "extra_logs": {"v": torch.tensor([1.0, 2.0])}}, 1, "w") == [
        {"score": 0.5, "info": {"v": [1.0, 2.0]}}
    ]
    with pytest.raises(ValueError, match="gave a dict per query; OpenRLHF's reply is one dict"):
        openrlhf_results({"rewards": [{"rewards": 0.5}]}, 1, "w")
    # called by position, as OpenRLHF calls reward_func; a missing label goes as "", as OpenRLHF sends it
    from rewards.adapters import adapt

    def scorer(q, p, labels_):
        return {"rewards": [float(labels_[0] == "" and q[0].startswith(p[0]))]}

    assert adapt(scorer, style="openrlhf")("p", "r", None, {}) == {"score": 1.0}


def test_the_model_text_is_made_only_for_an_openrlhf_reward(tmp_path: Path):
    """model_prompt and model_response cost a decode more per response: read off the spec, only an
    OpenRLHF-style part (or an OpenRLHF server) gets them."""
    from rewards.mix import reads_model_text
    from rewards.service import wants_model_text

    path = tmp_path / "reward_func.py"
    path.write_text(REWARD_FUNC_PY)
    openrlhf, native = f"{path}:reward_func", "envs.repeat:reward"
    assert reads_model_text(openrlhf) and not reads_model_text(native)
    assert reads_model_text({"mix": [{"fn": native, "weight": 1.0}, {"fn": openrlhf, "weight": 0.5}]})
    assert reads_model_text({"route": "task", "routes": {"a": native}, "default": openrlhf})
    assert not reads_model_text({"route": "task", "routes": {"a": native}})
    assert reads_model_text({"fn": "pkg.mod:factory", "kwargs": {}, "style": "openrlhf"})
    assert not reads_model_text({"fn": "rewards.prm:prm_reward", "kwargs": {"model_dir": "x"}})  # not called
    assert wants_model_text(RewardConfig(mode="http", url="http://h:5000/get_reward", http_format="openrlhf"))
    assert not wants_model_text(RewardConfig(mode="http", url="http://h:8000"))
    assert not wants_model_text(RewardConfig())
