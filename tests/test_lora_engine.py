"""LoRA pushes into the built-in engine (slime/engines/builtin/lora_merge.py), on the warm-started tiny MoE.

With learner.lora set every push carries only {module}.lora_A.weight and {module}.lora_B.weight; the
engine merges W = W_base + alpha / rank * B @ A in place. The reference is transformers' forward of
the same model with peft-injected adapters holding the pushed tensors (unmerged: B @ A runs in the
forward), on every forward path of the engine.
"""

from __future__ import annotations

import random

import pytest
import torch

from slime.config import ConfigError, JobConfig, load_config
from slime.engines import make_engine
from slime.engines.builtin import BuiltinEngine
from slime.engines.contract import GenerationChunk, GenerationRequest, SamplingParams
from slime.model import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # robust on a shared 2-core machine
RANK, ALPHA = 8, 16.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
TOL = 2e-4  # float32: the engine's merged weights vs peft's unmerged adapters


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return load_model(tiny_model_dir, "float32").eval()


def adapter(model: torch.nn.Module, seed: int, zero_b: bool = False, layers=None) -> dict[str, torch.Tensor]:
    """A push: random A [r, in] and B [out, r] for every attention projection (of ``layers``)."""
    g = torch.Generator().manual_seed(seed)
    push = {}
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS and (layers is None or int(name.split(".")[2]) in layers):
            push[f"{name}.lora_A.weight"] = torch.randn(RANK, mod.in_features, generator=g) * 0.1
            b = torch.randn(mod.out_features, RANK, generator=g) * 0.1
            push[f"{name}.lora_B.weight"] = torch.zeros_like(b) if zero_b else b
    return push


def with_peft(tiny_model_dir, push: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The same model with peft's LoRA layers injected (not merged), holding the pushed tensors."""
    peft = pytest.importorskip("peft")
    model = load_model(tiny_model_dir, "float32").eval()
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.inject_adapter_in_model(config, model)
    with torch.no_grad():
        injected = 0
        for name, mod in model.named_modules():
            if f"{name}.lora_A.weight" in push:
                mod.lora_A["default"].weight.copy_(push[f"{name}.lora_A.weight"])
                mod.lora_B["default"].weight.copy_(push[f"{name}.lora_B.weight"])
                injected += 1
    assert injected == len(push) // 2
    return model.eval()


def prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of the repeat task's alphabet (ids 6..), so the warm-started model is confident."""
    rng = random.Random(seed)
    return [[rng.randrange(6, 60) for _ in range(rng.randint(3, 12))] for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n)


@torch.no_grad()
def ref_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return logp[torch.arange(len(response)), torch.tensor(response)].tolist()


@torch.no_grad()
def ref_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


PATHS = {  # name -> (BuiltinEngine options, health()["forward"])
    "fast": ({}, "fast"),
    "fast-static": ({"cuda_graphs": True}, "fast"),  # the static decode steps, run eagerly on CPU
    "generic": ({"fast_path": "generic"}, "generic"),
    "hf": ({"fast_path": False}, "hf"),
}


@pytest.fixture(params=list(PATHS))
def engine(request, tiny_model_dir):
    options, forward = PATHS[request.param]
    eng = BuiltinEngine(
        load_model(tiny_model_dir, "float32"), max_running_requests=8, lora_scaling=ALPHA / RANK, **options
    )
    assert eng.health()["forward"] == forward
    assert eng.health()["static_decode"] == (request.param == "fast-static")
    return eng


def test_from_config_takes_alpha_over_rank(tiny_model_dir):
    cfg = JobConfig(learner={"lora": {"rank": 4, "alpha": 32.0}})
    eng = make_engine(cfg, str(tiny_model_dir), index=0, version=0)
    assert isinstance(eng, BuiltinEngine) and eng._lora.scaling == 8.0
    assert make_engine(JobConfig(), str(tiny_model_dir), index=0, version=0)._lora is None


def test_adapter_push_equals_the_peft_injected_model(engine, tiny_model_dir, base):
    push = adapter(base, seed=1)
    ref = with_peft(tiny_model_dir, push)
    ps = prompts(4, seed=2)
    base_tokens = {i: ref_greedy(base, p, 16) for i, p in enumerate(ps)}
    engine.update_weights(1, push.items())
    assert engine.version == 1 and engine.health()["lora_base_bytes"] > 0
    out = engine.generate([GenerationRequest(str(i), p, greedy(16)) for i, p in enumerate(ps)])
    changed = 0
    for i, p in enumerate(ps):
        c = out[str(i)]
        assert c.version == 1 and len(c.token_ids) == 16
        assert c.token_ids == ref_greedy(ref, p, 16)  # greedy tokens equal
        assert diff(c.logprobs, ref_logprobs(ref, p, c.token_ids)) < TOL  # behaviour logprobs
        assert diff(engine.score_logprobs(p, c.token_ids), ref_logprobs(ref, p, c.token_ids)) < TOL  # the probe
        changed += c.token_ids != base_tokens[i]
    assert changed > 0, "the adapter changed no greedy output"


def test_a_push_replaces_the_last_one_and_zero_b_gives_the_base_exactly(tiny_model_dir, base):
    engine = BuiltinEngine(load_model(tiny_model_dir, "float32"), max_running_requests=8, lora_scaling=ALPHA / RANK)
    p, r = prompts(1, seed=3)[0], prompts(1, seed=4)[0]
    loaded = {n: t.detach().clone() for n, t in engine.model.named_parameters()}
    ptrs = {n: t.data_ptr() for n, t in engine.model.named_parameters()}
    before = engine.score_logprobs(p, r)
    engine.update_weights(1, adapter(base, seed=5).items())
    second = adapter(base, seed=6)
    engine.update_weights(2, second.items())
    assert diff(engine.score_logprobs(p, r), ref_logprobs(with_peft(tiny_model_dir, second), p, r)) < TOL
    # a push of only layer 0's modules: the other layers' modules go back to W_base
    only0 = adapter(base, seed=7, layers=[0])
    engine.update_weights(3, only0.items())
    assert diff(engine.score_logprobs(p, r), ref_logprobs(with_peft(tiny_model_dir, only0), p, r)) < TOL
    engine.update_weights(4, adapter(base, seed=8, zero_b=True).items())
    assert engine.score_logprobs(p, r) == before  # bit for bit
    assert all(torch.equal(t, loaded[n]) for n, t in engine.model.named_parameters())
    assert ptrs == {n: t.data_ptr() for n, t in engine.model.named_parameters()}  # in place, no re-allocation
    assert engine.version == 4


def test_a_push_in_flight_keeps_running_requests_going(engine, base):
    ps = prompts(5, seed=9)
    for i, p in enumerate(ps):
        engine.add_request(GenerationRequest(str(i), p, greedy(24)))
    got: dict[str, GenerationChunk] = {}
    versions: list[int] = []

    def step():
        for c in engine.step():
            m = got.setdefault(c.request_id, GenerationChunk(c.request_id, [], [], c.version, False, None))
            m.token_ids += c.token_ids
            m.finished, m.finish_reason = c.finished, c.finish_reason
            versions.append(c.version)

    for _ in range(4):
        step()
    running, kv_len = engine.num_running(), engine.health()["kv_len"]
    engine.update_weights(1, adapter(base, seed=10).items())
    assert engine.num_running() == running == len(ps) and engine.health()["kv_len"] == kv_len  # caches kept
    while engine.has_unfinished():
        step()
    assert all(got[str(i)].finished and len(got[str(i)].token_ids) == 24 for i in range(len(ps)))
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)


def test_bad_pushes_raise_naming_the_tensor_and_change_nothing(engine, base):
    good = adapter(base, seed=11)
    q = "model.layers.0.self_attn.q_proj"
    a, b = good[f"{q}.lora_A.weight"], good[f"{q}.lora_B.weight"]
    weights = {n: t.detach().clone() for n, t in engine.model.named_parameters()}
    bad = {
        "model.embed_tokens.weight": [*good.items(), ("model.embed_tokens.weight", base.model.embed_tokens.weight)],
        "model.layers.0.self_attn.nope": [*good.items(), ("model.layers.0.self_attn.nope.lora_A.weight", a)]
        + [("model.layers.0.self_attn.nope.lora_B.weight", b)],
        "not a Linear": [*good.items(), ("model.layers.0.mlp.gate.lora_A.weight", a[:, :128])]
        + [("model.layers.0.mlp.gate.lora_B.weight", torch.zeros(8, RANK))],
        f"{q}.lora_A.weight": [(f"{q}.lora_A.weight", a[:, :-1]), (f"{q}.lora_B.weight", b)],
        f"{q}.lora_B.weight": [(f"{q}.lora_A.weight", a), (f"{q}.lora_B.weight", b[:-1])],
        f"{q}.lora_B.weight is missing": [(f"{q}.lora_A.weight", a)],
        f"{q}.lora_A.weight' appears twice": [(f"{q}.lora_A.weight", a), (f"{q}.lora_A.weight", a)],
        "empty": [],
    }
    for expected, push in bad.items():
        with pytest.raises(ValueError, match=expected.replace(".", r"\.")):
            engine.update_weights(1, push)
    assert engine.version == 0
    assert all(torch.equal(t, weights[n]) for n, t in engine.model.named_parameters())
    # an engine without LoRA takes no adapter: an unknown name, as before
    plain = BuiltinEngine(engine.model, max_running_requests=2)
    with pytest.raises(ValueError, match=f"unknown tensor name '{q}.lora_A.weight'"):
        plain.update_weights(1, [(f"{q}.lora_A.weight", a)])


def test_lora_is_refused_with_sglang_and_with_vllm_on_the_cpu_tiny_moe():
    with pytest.raises(ConfigError, match="learner.lora.*rollout.engine=sglang"):
        load_config(None, ["learner.lora.rank=8", "rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="learner.lora with rollout.engine=vllm on CPU.*Triton"):
        load_config(None, ["learner.lora.rank=8", "rollout.engine=vllm"])
    assert load_config(None, ["learner.lora.rank=8"]).learner.lora.rank == 8
