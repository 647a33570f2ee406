"""The SGLang adapter against the built-in engine's SGLang-protocol server, both real processes.

The same contract as the built-in engine: logprobs match a direct forward pass, abort returns the
partial and a resume continues token-exactly (greedy), weight updates by JSON tensor handle, by
disk (under the server's --weights-dir) and by broadcast change the outputs to the new weights,
health; plus a raw SGLang-shaped HTTP client. The server has a token (in its environment); the
adapter sends it on every request, raw clients on the control routes.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from slime.config import ConfigError, load_config
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.engines.sglang.adapter import SglangEngine
from slime.engines.sglang.processes import SglangServerProcess, free_port, launch_command
from slime.model import load_model
from slime.security import auth_headers, new_secret
from slime.train import train
from tests.helpers import drive_engine

PROMPT = [5, 12, 7, 30, 9, 14]
TOKEN = new_secret()
AUTH = auth_headers(TOKEN)


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    """The server's --weights-dir: disk updates load only under it."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, weights_root):
    port = free_port()
    cmd = launch_command(
        "slime",
        str(tiny_model_dir),
        "127.0.0.1",
        port,
        torch_threads=1,
        max_running_requests=8,
        weights_dir=weights_root,
        update_group_hosts=["127.0.0.1"],
    )
    proc = SglangServerProcess(
        cmd, f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("sglang") / "server.log", 120, token=TOKEN
    )
    yield proc
    proc.stop()


@pytest.fixture
def engine(server, weights_root):
    eng = SglangEngine(server.url, weights_dir=weights_root / "engine", request_timeout_s=60, api_token=TOKEN)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir).eval()


def _forward_logprobs(model, prompt, response, temperature=1.0) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(response)]


def test_generation_logprobs_match_a_direct_forward(engine, model):
    greedy = GenerationRequest("g", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=12))
    sampled = GenerationRequest("s", PROMPT[:4], SamplingParams(temperature=0.8, max_new_tokens=12))
    out = drive_engine(engine, [greedy, sampled])
    for rid, prompt, temperature in (("g", PROMPT, 1.0), ("s", PROMPT[:4], 0.8)):
        o = out[rid]
        assert o["reason"] == "length" and len(o["tokens"]) == 12
        assert (
            max(abs(a - b) for a, b in zip(o["logprobs"], _forward_logprobs(model, prompt, o["tokens"], temperature)))
            < 1e-4
        )
    with torch.no_grad():  # greedy really is the argmax of the model
        logits = model(input_ids=torch.tensor([PROMPT + out["g"]["tokens"]])).logits[0]
    assert logits[len(PROMPT) - 1 : -1].argmax(-1).tolist() == out["g"]["tokens"]
    assert engine.score_logprobs(PROMPT, out["g"]["tokens"][:5]) == pytest.approx(out["g"]["logprobs"][:5], abs=1e-4)


def test_a_requests_own_seed_reaches_the_server_as_sampling_seed(engine):
    """SamplingParams.seed travels as SGLang's `sampling_seed`: the same seed, the same tokens,
    whatever else the server runs; another seed, other tokens."""

    def sampled(rid: str, seed: int, prompt=PROMPT) -> GenerationRequest:
        return GenerationRequest(rid, prompt, SamplingParams(temperature=1.0, max_new_tokens=16, seed=seed))

    alone = drive_engine(engine, [sampled("a", 5)])["a"]["tokens"]
    beside = drive_engine(engine, [sampled("b", 5), sampled("c", 5, PROMPT[:3]), sampled("d", 6)])
    assert beside["b"]["tokens"] == alone and beside["d"]["tokens"] != alone


def test_abort_returns_the_partial_and_resume_is_token_exact(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=120)
    reference = drive_engine(engine, [GenerationRequest("ref", PROMPT, params)])["ref"]["tokens"]
    assert len(reference) == 120

    engine.add_request(GenerationRequest("a", PROMPT, params))
    partial, logprobs = [], []
    while len(partial) < 5:
        for c in engine.step():
            partial += c.token_ids
            logprobs += c.logprobs
    chunks = engine.abort(None)
    assert [c.finish_reason for c in chunks] == ["abort"] and chunks[0].request_id == "a"
    partial += chunks[0].token_ids
    assert 5 <= len(partial) < 120 and not engine.has_unfinished()

    resumed = drive_engine(engine, [GenerationRequest("a", PROMPT, params, response_ids=partial)])["a"]
    assert resumed["reason"] == "length"
    assert partial + resumed["tokens"] == reference  # max_new_tokens reduced by the resumed prefix

    done = drive_engine(
        engine, [GenerationRequest("b", PROMPT, SamplingParams(max_new_tokens=3), response_ids=reference[:3])]
    )
    assert done["b"] == {"tokens": [], "logprobs": [], "reason": "length"}  # nothing left: finished at once


def test_a_stop_string_of_several_tokens_ends_the_response_and_the_stream(engine, server):
    """The server runs token ids only: the adapter matches stop_strings in the decoded response,
    cuts after the token that completed one and leaves the stream (the server drops the request);
    resumed with it, finished at once."""
    letters = lambda ids: "".join(chr(ord("a") + t % 26) for t in ids)  # noqa: E731
    free = drive_engine(engine, [GenerationRequest("free", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=40))])
    text = letters(free["free"]["tokens"])
    stop = text[5:7]
    end = text.index(stop) + len(stop)
    engine._decode = letters
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_strings=[stop])
    out = drive_engine(engine, [GenerationRequest("str", PROMPT, params)])["str"]
    assert out["tokens"] == free["free"]["tokens"][:end] and out["reason"] == "stop"
    again = drive_engine(engine, [GenerationRequest("str2", PROMPT, params, response_ids=out["tokens"])])["str2"]
    assert again == {"tokens": [], "logprobs": [], "reason": "stop"}
    # The next model turn of an episode comes at once under the same request id: the server has
    # dropped the stopped one by then (the adapter aborts it before reporting the stop).
    for turn in range(3):
        first = drive_engine(engine, [GenerationRequest("turns", PROMPT, params)])["turns"]
        assert first["reason"] == "stop", turn
        follow = SamplingParams(temperature=0.0, max_new_tokens=len(first["tokens"]) + 4)
        nxt = drive_engine(engine, [GenerationRequest("turns", PROMPT, follow, response_ids=first["tokens"])])["turns"]
        assert nxt["reason"] == "length" and len(nxt["tokens"]) == 4, (turn, nxt)
    health = httpx.get(f"{server.url}/health_generate", headers=AUTH, timeout=10)
    assert health.status_code == 200  # the server goes on serving after the client left the stream


def _perturbed(model, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + 0.3 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


def test_weight_updates_by_tensor_handle_disk_and_broadcast_change_outputs(
    engine, server, model, tiny_model_dir, weights_root
):
    probe = [3, 8, 21, 4]
    before = engine.score_logprobs(PROMPT, probe)
    assert before == pytest.approx(_forward_logprobs(model, PROMPT, probe), abs=1e-4)
    engines = {
        "tensor": engine,
        **{
            m: SglangEngine(server.url, weight_update=m, weights_dir=weights_root / "w", bucket_mb=0.2, api_token=TOKEN)
            for m in ("disk", "distributed")
        },
    }
    try:
        # distributed twice: the second update reuses the group (bucketed: several requests per update)
        for mode, seed, version in (("tensor", 1, 7), ("disk", 2, 8), ("distributed", 3, 9), ("distributed", 4, 10)):
            eng = engines[mode]
            named = _perturbed(model, seed)
            eng.update_weights(version, named)
            if mode == "tensor":  # the built-in server gets the JSON handle, never a pickle
                assert eng._builtin == {server.url: True}
            new_model = load_model(tiny_model_dir)
            new_model.load_state_dict(dict(named), strict=False)
            expected = _forward_logprobs(new_model.eval(), PROMPT, probe)
            got = eng.score_logprobs(PROMPT, probe)
            assert got == pytest.approx(expected, abs=1e-4), mode
            assert max(abs(a - b) for a, b in zip(got, before)) > 1e-2, mode
            out = drive_engine(
                eng, [GenerationRequest(mode, PROMPT, SamplingParams(temperature=0.0, max_new_tokens=4))]
            )
            assert httpx.get(f"{server.url}/get_model_info").json()["weight_version"] == str(version)
            with torch.no_grad():  # greedy tokens of the new weights, stamped with the new version
                logits = new_model(input_ids=torch.tensor([PROMPT + out[mode]["tokens"]])).logits[0]
            assert logits[len(PROMPT) - 1 : -1].argmax(-1).tolist() == out[mode]["tokens"]
            assert eng.version == version
    finally:  # later tests (and other modules) see the original weights
        engine.update_weights(0, list(model.named_parameters()))
        engines["disk"].close()
        engines["distributed"].close()
    assert engine.score_logprobs(PROMPT, probe) == pytest.approx(before, abs=1e-5)


def test_update_weights_keeps_running_requests(engine, model):
    """pause(in_place) -> update -> continue: a running request survives, later tokens carry the new version."""
    engine.add_request(GenerationRequest("long", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=60)))
    chunks = []
    while sum(len(c.token_ids) for c in chunks) < 3:
        chunks += engine.step()
    engine.update_weights(1, list(model.named_parameters()))  # same values, new version
    while engine.has_unfinished():
        chunks += engine.step()
    assert sum(len(c.token_ids) for c in chunks) == 60 and chunks[-1].finish_reason == "length"
    assert chunks[0].version == 0 and chunks[-1].version == 1 and engine.version == 1


def test_health_and_bad_input(engine, server):
    h = engine.health()
    assert h["healthy"] and h["running"] == 0
    assert httpx.post(f"{server.url}/flush_cache", json={}, headers=AUTH).status_code == 200
    assert httpx.post(f"{server.url}/flush_cache", json={}).status_code == 401  # state-changing: the token
    r = httpx.post(
        f"{server.url}/generate", headers=AUTH, json={"input_ids": [1, 2], "sampling_params": {"stop": ["x"]}}
    )
    assert r.status_code == 400 and "stop" in r.json()["message"]
    r = httpx.post(
        f"{server.url}/generate",
        headers=AUTH,
        json={"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}},
    )
    assert r.status_code == 400 and "repetition_penalty" in r.json()["message"]
    r = httpx.post(f"{server.url}/generate", headers=AUTH, json={"sampling_params": {}})
    assert r.status_code == 400 and "input_ids" in r.json()["message"]
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        launch_command("slime", "m", "127.0.0.1", 1, tensor_parallel_size=2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sglang.num_servers=2"], "sglang.num_servers=2: several servers need sglang.router=sglang_router"),
        (["sglang.urls=[http://a:1,http://b:2]"], "sglang.urls lists 2 servers: several servers need sglang.router"),
        (
            ["sglang.url=http://a:1", "sglang.num_servers=2", "sglang.router=sglang_router"],
            "list every server in sglang.urls",
        ),
        (["sglang.url=http://a:1", "sglang.urls=[http://b:1]"], "not both"),
        (["sglang.router_port=31000"], "sglang.router=none launches no router"),
        (["sglang.router=sglang_router", "sglang.router_policy=power_of_two"], "power_of_two needs at least 2 servers"),
        (["sglang.router=sglang_router", "sglang.router_policy=manual"], "sglang.router_policy"),
    ],
)
def test_router_config_is_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(None, overrides)
    load_config(None, ["sglang.num_servers=2", "sglang.router=sglang_router", "sglang.router_policy=power_of_two"])
    load_config(
        None, ["sglang.urls=[http://a:1,http://b:2]", "sglang.router=sglang_router", "sglang.router_port=31000"]
    )


def test_raw_sglang_client(server, model):
    """A client written for SGLang: the request and response shapes of its native /generate."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": 6,
            "top_k": -1,
            "ignore_eos": True,
            "frequency_penalty": 0.0,
            "n": 1,
            "skip_special_tokens": True,
        },  # neutral: accepted
        "return_logprob": True,
        "rid": "raw-1",
    }
    out = httpx.post(f"{server.url}/generate", headers=AUTH, json=body, timeout=60).json()
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"} and len(out["output_ids"]) == 6
    assert meta["id"] == "raw-1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["completion_tokens"] == 6 and meta["prompt_tokens"] == len(PROMPT)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert lps == pytest.approx(_forward_logprobs(model, PROMPT, out["output_ids"]), abs=1e-4)

    # streaming: cumulative SSE events, then [DONE]; abort_all ends it with finish_reason abort
    events: list[dict] = []

    def stream():
        with httpx.stream(
            "POST",
            f"{server.url}/generate",
            headers=AUTH,
            json={
                **body,
                "rid": "raw-2",
                "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
            },
            timeout=60,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.time() + 30
    while len(events) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert (
        httpx.post(f"{server.url}/abort_request", json={"rid": "", "abort_all": True}, headers=AUTH).status_code == 200
    )
    t.join(timeout=30)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= last["meta_info"]["completion_tokens"] < 400
    assert events[0]["output_ids"] == last["output_ids"][: len(events[0]["output_ids"])]  # cumulative

    # pause in place keeps a request; continue finishes it
    assert (
        httpx.post(f"{server.url}/pause_generation", json={"mode": "in_place"}, headers=AUTH).json()["status"] == "ok"
    )
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.update(
            httpx.post(f"{server.url}/generate", headers=AUTH, json={**body, "rid": "raw-3"}, timeout=60).json()
        )
    )
    t.start()
    time.sleep(0.3)
    assert not result  # paused: nothing generated
    assert httpx.post(f"{server.url}/continue_generation", json={}, headers=AUTH).status_code == 200
    t.join(timeout=30)
    assert result["output_ids"] == out["output_ids"]


@pytest.mark.slow
def test_training_job_on_the_sglang_engine(ray_session, tiny_model_dir, redis_url, tmp_path):
    """rollout.engine=sglang end to end: the worker launches the SGLang-protocol server, generates
    through it, and the probe check after each weight update passes."""
    history = train(
        load_config(
            None,
            [
                "job_name=e2e-sglang",
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
                "weights.check_every=1",
                "steps=2",
            ],
        )
    )
    assert len(history) == 2 and all(m["generated_tokens"] > 0 for m in history)
    assert (tmp_path / "sglang" / "server_0.log").exists()
