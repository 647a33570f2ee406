"""The built-in engine's fast forward (slime/engines/fast_decoder.py) against Hugging Face's forward."""

from __future__ import annotations

import random

import pytest
import torch

from slime.config import TinyModelConfig
from slime.dashboard.experts import ExpertLoadRecorder
from slime.engine import GenerationRequest, RolloutEngine, SamplingParams
from slime.engines.fast_decoder import FastDecoder, fast_decoder_for
from slime.model import build_tiny_moe

VOCAB = 64


@pytest.fixture(scope="module", autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiny_moe(seed: int = 0) -> torch.nn.Module:
    return build_tiny_moe(TinyModelConfig(), VOCAB, seed).float().eval()


def tiny_dense(kind: str) -> torch.nn.Module:
    """A small dense Llama / Qwen2 (q/k/v bias) / Qwen3 (q/k norm), random init."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()


def prompts(n: int, seed: int, lo: int = 1, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(engine: RolloutEngine, ps, params_of, rid="r"):
    out = engine.generate([GenerationRequest(f"{rid}{i}", p, params_of(i)) for i, p in enumerate(ps)])
    return [out[f"{rid}{i}"] for i in range(len(ps))]


def reference_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(response)]


@pytest.mark.parametrize("kind", ["moe", "llama", "qwen2", "qwen3"])
def test_fast_path_is_taken_and_greedy_equals_hf_path(kind):
    model = tiny_moe() if kind == "moe" else tiny_dense(kind)
    fast = RolloutEngine(model, max_running_requests=32)
    hf = RolloutEngine(model, max_running_requests=32, fast_path=False)
    assert fast.health()["forward"] == "fast" and hf.health()["forward"] == "hf"
    ps = prompts(20, seed=1)
    budgets = [random.Random(i).randint(1, 40) for i in range(20)]
    greedy = lambda i: SamplingParams(temperature=0.0, max_new_tokens=budgets[i])
    got, want = run(fast, ps, greedy), run(hf, ps, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for c, w in zip(got, want):
        assert c.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_sampled_logprobs_equal_the_model_forward_through_growth_and_compaction():
    """Rows finish at different steps (holes filled from the tail), more rows and longer contexts
    than the first cache allocation (8 rows, 64 positions): every reported logprob must still be
    the model's own tempered logprob of that token."""
    model = tiny_moe(3)
    engine = RolloutEngine(model, max_running_requests=40, seed=5)
    ps = prompts(30, seed=2, lo=1, hi=60)
    rng = random.Random(0)
    params = [SamplingParams(temperature=0.7, top_k=rng.choice([0, 10]), max_new_tokens=rng.randint(1, 150))
              for _ in ps]
    chunks = run(engine, ps, lambda i: params[i])
    assert max(len(p) + len(c.token_ids) for p, c in zip(ps, chunks)) > 128
    for p, c, sp in zip(ps, chunks, params):
        assert len(c.token_ids) == sp.max_new_tokens
        assert c.logprobs == pytest.approx(reference_logprobs(model, p, c.token_ids, 0.7), abs=2e-4)


def test_staggered_arrivals_aborts_and_resume_equal_running_alone():
    model = tiny_moe(1)
    engine = RolloutEngine(model, max_running_requests=6)
    ps = prompts(10, seed=4, lo=2, hi=25)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30)
    alone = [run(engine, [p], lambda i: greedy, rid=f"alone{k}-")[0].token_ids for k, p in enumerate(ps)]
    got: dict[str, list[int]] = {}
    for i, p in enumerate(ps):  # a newcomer every step, more than the 6 slots
        engine.add_request(GenerationRequest(f"q{i}", p, greedy))
        for c in engine.step():
            got.setdefault(c.request_id, []).extend(c.token_ids)
    partials = engine.abort(None)
    assert partials
    for c in partials:
        got.setdefault(c.request_id, [])
    for i, p in enumerate(ps):  # resume each from its stored tokens
        engine.add_request(GenerationRequest(f"q{i}", p, greedy, list(got[f"q{i}"])))
    while engine.has_unfinished():
        for c in engine.step():
            got[c.request_id].extend(c.token_ids)
    assert [got[f"q{i}"] for i in range(len(ps))] == alone


def test_weight_update_in_place_reaches_the_fast_path():
    model, other = tiny_moe(0), tiny_moe(7)
    engine = RolloutEngine(model, max_running_requests=8)
    reference = RolloutEngine(other, max_running_requests=8, fast_path=False)
    ps = prompts(4, seed=9)
    greedy = lambda i: SamplingParams(temperature=0.0, max_new_tokens=20)
    before = [c.token_ids for c in run(engine, ps, greedy)]
    engine.update_weights(1, other.state_dict().items())
    after = [c.token_ids for c in run(engine, ps, greedy)]
    assert after == [c.token_ids for c in run(reference, ps, greedy)]
    assert after != before


def test_router_hooks_still_fire_for_the_expert_load_recorder():
    model = tiny_moe(0)
    engine = RolloutEngine(model, max_running_requests=8)
    recorder = ExpertLoadRecorder.attach(model)
    ps = prompts(3, seed=11, lo=5, hi=5)
    run(engine, ps, lambda i: SamplingParams(temperature=0.0, max_new_tokens=10))
    counts = recorder.take()
    cfg = TinyModelConfig()
    # Each layer routes every fed token to top-k experts: 15 prompt tokens + 3 x 9 decode inputs.
    assert counts.shape == (cfg.num_layers, cfg.num_experts)
    assert (counts.sum(1) == (15 + 27) * cfg.experts_per_token).all()
    recorder.detach()


def test_unsupported_model_uses_the_hf_forward_and_fast_path_true_says_why():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert RolloutEngine(gpt2).health()["forward"] == "hf"
    with pytest.raises(ValueError, match="fast_path=True"):
        RolloutEngine(gpt2, fast_path=True)


def test_a_model_whose_numbers_differ_is_refused():
    """A forward hook that changes an MLP's output is invisible to the fast forward: the start-up
    check compares logits and keeps the Hugging Face path."""
    model = tiny_moe(0)
    assert isinstance(fast_decoder_for(model, 8, 128), FastDecoder)
    model.model.layers[1].mlp.register_forward_hook(lambda module, inputs, output: output * 1.5)
    assert fast_decoder_for(model, 8, 128) is None
    assert RolloutEngine(model).health()["forward"] == "hf"
