"""Two SGLang-protocol servers behind the real sglang-router, launched by the adapter, all real processes.

`SglangEngine.from_config` with ``sglang.num_servers=2 sglang.router=sglang_router``: requests go
through the router to both servers; greedy outputs equal the built-in engine run directly;
abort returns the partials and a resume (on whichever server the router picks) is token-exact;
a weight update (tensor handle and broadcast) reaches every server and a server that missed one
fails the probe; a killed server or router is named by `health()` and `step()`. The router and the
servers get the job's token in their environment (never argv); the router requires it and
passes it on.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e .[dev] installs it)")

from slime.config import load_config  # noqa: E402
from slime.engines.builtin import BuiltinEngine  # noqa: E402
from slime.engines.contract import GenerationRequest, SamplingParams  # noqa: E402
from slime.engines.sglang.adapter import SglangEngine  # noqa: E402
from slime.model import load_model  # noqa: E402
from slime.security import auth_headers, new_secret  # noqa: E402
from slime.train import train  # noqa: E402
from tests.helpers import drive_engine  # noqa: E402

PROMPTS = [[5, 12, 7, 30, 9, 14], [3, 8, 21, 4], [17, 2, 9], [11, 6, 25, 13, 1]]
TOKEN = new_secret()
AUTH = auth_headers(TOKEN)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def routed(tiny_model_dir, tmp_path_factory):
    """One rollout worker's engine: two servers and a round-robin router in front of them."""
    out = tmp_path_factory.mktemp("routed")
    cfg = load_config(
        None,
        [
            f"output_dir={out}",
            f"model.path={tiny_model_dir}",
            "rollout.engine=sglang",
            "rollout.max_running_requests=4",
            "sglang.launcher=slime",
            "sglang.num_servers=2",
            "sglang.router=sglang_router",
            "sglang.router_policy=round_robin",
            "sglang.request_timeout_s=60",
            "sglang.startup_timeout_s=120",
        ],
    )
    engine = SglangEngine.from_config(cfg, str(tiny_model_dir), 0, 0, api_token=TOKEN)
    yield engine
    engine.close()


def _tokens_generated(url: str) -> int:
    return httpx.get(f"{url}/server_info", timeout=10).json()["tokens_generated"]


def _forward_logprobs(model, prompt, response) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + response])).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(response)]


def test_launch_layout(routed, tiny_model_dir):
    assert len(routed.server_urls) == 2 and routed.url not in routed.server_urls
    names = [p.name for p in routed.processes]
    assert names == [
        "SGLang server 0 of rollout worker 0",
        "SGLang server 1 of rollout worker 0",
        "sglang-router of rollout worker 0",
    ]
    assert [p.log_path.name for p in routed.processes] == ["server_0_0.log", "server_0_1.log", "router_0.log"]
    workers = httpx.get(f"{routed.url}/workers", headers=AUTH, timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(routed.server_urls) and all(w["is_healthy"] for w in workers)
    # the router read each server's /server_info (it drops an answer whose field types differ from SGLang's)
    assert all(w["model_id"] == str(tiny_model_dir) for w in workers)
    h = routed.health()
    assert h["healthy"] and h["error"] is None and h["server_urls"] == routed.server_urls


def test_the_token_reaches_every_process_by_environment_only(routed):
    """sglang-router 0.3.2 with --api-key (added inside the process by slime.engines.sglang.launch):
    it refuses clients without the key, and forwards it to the servers, whose /generate then
    works through it; no process shows the key in its command line."""
    for proc in routed.processes:
        cmdline = open(f"/proc/{proc.proc.pid}/cmdline", "rb").read()
        assert TOKEN.encode() not in cmdline and b"--api-key" not in cmdline, proc.name
        if "router" not in proc.name:  # (the router's setproctitle rewrites its argv and environment area)
            environ = open(f"/proc/{proc.proc.pid}/environ", "rb").read()
            assert f"SLIME_API_TOKEN={TOKEN}".encode() in environ.split(b"\0"), proc.name
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    for headers, status in (({}, 401), (auth_headers("wrong"), 401), (AUTH, 200)):
        assert httpx.post(f"{routed.url}/generate", json=body, headers=headers, timeout=30).status_code == status
        assert httpx.get(f"{routed.url}/workers", headers=headers, timeout=10).status_code == status
    for url in routed.server_urls:  # the servers' control routes need it too
        assert httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}).status_code == 401


def test_requests_reach_both_servers_and_greedy_equals_the_builtin_engine(routed, model):
    before = [_tokens_generated(u) for u in routed.server_urls]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    reqs = [GenerationRequest(f"g{i}", p, params) for i, p in enumerate(PROMPTS)]
    got = drive_engine(routed, reqs)
    after = [_tokens_generated(u) for u in routed.server_urls]
    assert all(a > b for a, b in zip(after, before)), f"round robin left a server idle: {before} -> {after}"
    assert sum(after) - sum(before) == 16 * len(PROMPTS)

    builtin = BuiltinEngine(model, device="cpu", max_running_requests=4)
    expected = drive_engine(builtin, [GenerationRequest(f"g{i}", p, params) for i, p in enumerate(PROMPTS)])
    for rid in expected:
        assert got[rid]["reason"] == "length"
        assert got[rid]["tokens"] == expected[rid]["tokens"], rid
        assert got[rid]["logprobs"] == pytest.approx(expected[rid]["logprobs"], abs=1e-4)


def test_abort_returns_partials_and_resume_is_token_exact(routed):
    params = SamplingParams(temperature=0.0, max_new_tokens=100)
    reqs = [GenerationRequest(f"ref{i}", p, params) for i, p in enumerate(PROMPTS[:2])]
    reference = {
        r.request_id.removeprefix("ref"): o["tokens"] for r, o in zip(reqs, drive_engine(routed, reqs).values())
    }

    partial = {str(i): [] for i in range(2)}
    for i, p in enumerate(PROMPTS[:2]):
        routed.add_request(GenerationRequest(str(i), p, params))
    deadline = time.time() + 30
    while min(len(t) for t in partial.values()) < 4:  # both running, on different servers (round robin)
        assert time.time() < deadline
        for c in routed.step():
            partial[c.request_id] += c.token_ids
    chunks = routed.abort(None)
    assert sorted(c.request_id for c in chunks) == ["0", "1"] and {c.finish_reason for c in chunks} == {"abort"}
    for c in chunks:
        partial[c.request_id] += c.token_ids
    assert all(4 <= len(t) < 100 for t in partial.values()) and not routed.has_unfinished()

    resumed = drive_engine(
        routed, [GenerationRequest(str(i), p, params, response_ids=partial[str(i)]) for i, p in enumerate(PROMPTS[:2])]
    )
    for rid in partial:
        assert resumed[rid]["reason"] == "length"
        assert partial[rid] + resumed[rid]["tokens"] == reference[rid]


def _perturbed(model, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + 0.3 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


def test_weight_update_reaches_every_server_and_a_missed_one_is_caught(routed, model, tiny_model_dir):
    prompt, probe = PROMPTS[0], [3, 8, 21, 4]
    # each server on its own, not through the router
    singles = [
        SglangEngine(u, weight_update="disk", weights_dir=routed.weights_dir / f"single_{j}", api_token=TOKEN)
        for j, u in enumerate(routed.server_urls)
    ]
    original = list(model.named_parameters())
    try:
        for mode, seed, version in (("tensor", 1, 3), ("distributed", 2, 4)):
            routed.weight_update = mode
            named = _perturbed(model, seed)
            routed.update_weights(version, named)
            new_model = load_model(tiny_model_dir)
            new_model.load_state_dict(dict(named), strict=False)
            expected = _forward_logprobs(new_model.eval(), prompt, probe)
            for single in singles:
                assert single.score_logprobs(prompt, probe) == pytest.approx(expected, abs=1e-4), (mode, single.url)
                assert httpx.get(f"{single.url}/model_info").json()["weight_version"] == str(version)
            assert routed.score_logprobs(prompt, probe) == pytest.approx(expected, abs=1e-4)

        # server 1 alone gets other weights: the probe, asked of every server, catches it
        singles[1].update_weights(5, _perturbed(model, 3))
        with pytest.raises(RuntimeError, match=f"server {routed.server_urls[1]} differs"):
            routed.score_logprobs(prompt, probe)
    finally:
        routed.weight_update = "tensor"
        routed.update_weights(0, original)
        for single in singles:
            single.close()
    assert routed.score_logprobs(prompt, probe) == pytest.approx(_forward_logprobs(model, prompt, probe), abs=1e-4)


def test_a_killed_server_or_router_is_named(routed):
    """Last in this module: it kills the fixture's processes."""
    params = SamplingParams(temperature=0.0, max_new_tokens=400)
    for i, p in enumerate(PROMPTS[:2]):
        routed.add_request(GenerationRequest(f"k{i}", p, params))
    seen = 0
    while seen < 4:
        seen += sum(len(c.token_ids) for c in routed.step())
    server1, router = routed.processes[1], routed.processes[2]
    os.kill(server1.proc.pid, signal.SIGKILL)
    server1.proc.wait(timeout=10)
    h = routed.health()
    assert not h["healthy"]
    assert "SGLang server 1 of rollout worker 0" in h["error"] and str(server1.log_path) in h["error"]
    assert "exited with code -9" in h["error"]
    with pytest.raises(RuntimeError, match="SGLang server 1 of rollout worker 0") as failed:
        for _ in range(100):
            routed.step()
    assert str(server1.log_path) in str(failed.value)

    os.kill(router.proc.pid, signal.SIGKILL)
    router.proc.wait(timeout=10)
    error = routed.health()["error"]
    assert "sglang-router of rollout worker 0" in error and str(router.log_path) in error


@pytest.mark.slow
def test_training_job_with_two_servers_behind_the_router(ray_session, tiny_model_dir, redis_url, tmp_path):
    """rollout.engine=sglang with sglang.num_servers=2 end to end: the worker launches both servers
    and the router, generates through it, and the probe check after each update asks both servers."""
    history = train(
        load_config(
            None,
            [
                "job_name=e2e-sglang-router",
                f"output_dir={tmp_path}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                "rollout.batch_size=2",
                "rollout.n_samples_per_prompt=2",
                "rollout.max_new_tokens=24",
                "data.num_generated=32",
                "logging.progress=false",
                "rollout.engine=sglang",
                "sglang.launcher=slime",
                "sglang.num_servers=2",
                "sglang.router=sglang_router",
                "weights.check_every=1",
                "steps=2",
                # Colocated placement's release through the SGLang protocol (/release_memory_occupation
                # while the learner trains, /resume_memory_occupation before the weight update).
                "rollout.release_memory=true",
            ],
        )
    )
    assert len(history) == 2 and all(m["generated_tokens"] > 0 for m in history)
    assert all(m["engine_memory_released_bytes"] > 0 for m in history)
    logs = sorted(p.name for p in (tmp_path / "sglang").glob("*.log"))
    assert logs == ["router_0.log", "server_0_0.log", "server_0_1.log"]
