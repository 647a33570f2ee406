"""The engine's fast path for any decoder family (slime/engines/builtin/generic_decoder.py): the model's
own modules with the engine's attention over the slot KV cache. Every family of
benchmarks/families.py takes a fast path whose logits and greedy tokens are the model's own,
and an aborted request resumes token-exactly on families with MLA, sliding windows and sinks."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.families import FAMILIES, buildable_families, tiny_model
from benchmarks.multiturn_kv import run_turns
from slime.engines.builtin import BuiltinEngine
from slime.engines.builtin.fast_decoder import FastDecoder
from slime.engines.builtin.generic_decoder import fast_decoder_for
from slime.engines.contract import GenerationRequest, SamplingParams

VOCAB = 97


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # robust on a shared 2-core machine


def prompts(n: int, seed: int, lo: int = 2, hi: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy_with_hf_generate(model, prompt: list[int], n: int) -> list[int]:
    """`model.generate`, greedy, n tokens whatever they are (no end-of-sequence token)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0)
    eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), generation_config=config)
    finally:
        model.generation_config.eos_token_id = eos
    return out[0, len(prompt) :].tolist()


def reference_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response]), use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(response)]


@pytest.mark.parametrize("path", ["fast", "generic"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_takes_both_fast_paths_with_the_models_tokens_and_logprobs(family, path):
    """Every family fits the hand-written layers (the default) and the generic path (asked for)."""
    model = tiny_model(family, VOCAB)
    engine = BuiltinEngine(model, max_running_requests=8, max_seq_len=256, fast_path=None if path == "fast" else path)
    assert engine.health()["forward"] == path
    ps = prompts(6, seed=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=14, stop_token_ids=[])
    out = engine.generate([GenerationRequest(f"r{i}", p, greedy) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        got = out[f"r{i}"]
        assert got.token_ids == greedy_with_hf_generate(model, p, 14), (family, i)
        assert got.logprobs == pytest.approx(reference_logprobs(model, p, got.token_ids), abs=2e-4)


@pytest.mark.parametrize("family", ["phi3", "olmoe", "qwen2_moe", "gpt_oss", "gemma3_text", "deepseek_v2"])
def test_an_in_place_weight_update_reaches_the_hand_written_layers(family):
    """Fused q/k/v and gate/up projections (Phi-3) are read as views; q/k norms over the whole
    projection (OLMoE), shared experts (Qwen2-MoE), an MoE run as the model's own module
    (gpt-oss), Gemma's norms (its own modules) and latent attention (DeepSeek-V2) from the live
    parameters: after an update in place the engine's greedy tokens are `generate`'s on the new
    weights."""
    model, other = tiny_model(family, VOCAB, seed=0), tiny_model(family, VOCAB, seed=7)
    engine = BuiltinEngine(model, max_running_requests=8)
    assert engine.health()["forward"] == "fast"
    ps = prompts(4, seed=9)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=[])

    def tokens() -> list[list[int]]:
        out = engine.generate([GenerationRequest(f"r{i}", p, greedy) for i, p in enumerate(ps)])
        return [out[f"r{i}"].token_ids for i in range(len(ps))]

    before = tokens()
    engine.update_weights(1, other.state_dict().items())
    after = tokens()
    assert after == [greedy_with_hf_generate(other, p, 16) for p in ps]
    assert after != before


def test_the_generic_path_equals_the_hand_written_one_on_the_default_moe():
    model = tiny_model("qwen3_moe", VOCAB)
    hand = BuiltinEngine(model, max_running_requests=16)
    generic = BuiltinEngine(model, max_running_requests=16, fast_path="generic")
    assert hand.health()["forward"] == "fast" and generic.health()["forward"] == "generic"
    ps = prompts(12, seed=2, lo=1, hi=30)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[])
    a = hand.generate([GenerationRequest(f"r{i}", p, greedy) for i, p in enumerate(ps)])
    b = generic.generate([GenerationRequest(f"r{i}", p, greedy) for i, p in enumerate(ps)])
    for i in range(len(ps)):
        assert a[f"r{i}"].token_ids == b[f"r{i}"].token_ids
        assert a[f"r{i}"].logprobs == pytest.approx(b[f"r{i}"].logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "family,forward", [("deepseek_v3", "fast"), ("deepseek_v2", "generic"), ("gemma2", "fast"), ("gpt_oss", "generic")]
)
def test_an_aborted_request_resumes_token_exactly_on_mla_windows_and_sinks(family, forward):
    """MLA attention (DeepSeek-V2/V3), sliding windows with soft-capping (Gemma 2) and with sinks
    (gpt-oss), on the hand-written layers and the generic path: aborted at several points and resumed with its stored
    tokens (from the kept cache, or by a prefill), each request ends exactly as an uninterrupted
    run, past the sliding window."""
    model = tiny_model(family, VOCAB)
    ps = prompts(6, seed=3, lo=2, hi=12)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=[])
    path = None if forward == "fast" else forward
    alone = BuiltinEngine(model, max_running_requests=8, fast_path=path)
    assert alone.health()["forward"] == forward
    want = alone.generate([GenerationRequest(f"q{i}", p, greedy) for i, p in enumerate(ps)])
    for kept in (0, 10_000):
        engine = BuiltinEngine(model, max_running_requests=8, kept_kv_tokens=kept, fast_path=path)
        got: dict[str, list[int]] = {}
        lps: dict[str, list[float]] = {}
        for i, p in enumerate(ps):
            engine.add_request(GenerationRequest(f"q{i}", p, greedy))
        for cut in (4, 9, 2):
            for _ in range(cut):
                for c in engine.step():
                    got.setdefault(c.request_id, []).extend(c.token_ids)
                    lps.setdefault(c.request_id, []).extend(c.logprobs)
            for c in engine.abort(None):
                i = int(c.request_id[1:])
                engine.add_request(GenerationRequest(c.request_id, ps[i], greedy, list(got[c.request_id])))
        while engine.has_unfinished():
            for c in engine.step():
                got.setdefault(c.request_id, []).extend(c.token_ids)
                lps.setdefault(c.request_id, []).extend(c.logprobs)
        for i in range(len(ps)):
            assert got[f"q{i}"] == want[f"q{i}"].token_ids, (kept, i)
            assert lps[f"q{i}"] == pytest.approx(want[f"q{i}"].logprobs, abs=1e-4)
        if kept:
            assert engine.health()["kv_resumes"] > 0


@pytest.mark.parametrize(
    "family,forward", [("deepseek_v3", "fast"), ("deepseek_v2", "generic"), ("gemma2", "fast"), ("gpt_oss", "generic")]
)
def test_a_turn_fed_onto_a_kept_cache_equals_a_prefill_on_mla_windows_and_sinks(family, forward):
    """Multi-turn on MLA, sliding windows with soft-capping and with sinks: each turn comes back
    with an observation after its tokens and feeds only that onto the finished turn's kept cache;
    tokens and logprobs are those of an engine that prefills every turn, past the sliding window."""
    model = tiny_model(family, VOCAB)
    ps = prompts(4, seed=5, lo=2, hi=10)
    rng = random.Random(6)
    observations = [[[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))] for _ in ps] for _ in range(2)]
    path = None if forward == "fast" else forward
    outputs = []
    for kept in (10_000, 0):
        engine = BuiltinEngine(model, max_running_requests=8, kept_kv_tokens=kept, fast_path=path)
        assert engine.health()["forward"] == forward
        outputs.append([got for got, _ in run_turns(engine, ps, [0.0] * len(ps), observations, [6, 9, 7])])
        assert engine.health()["kv_resumes"] == (2 * len(ps) if kept else 0)
    for with_kept, with_prefill in zip(*outputs):
        for rid, chunk in with_kept.items():
            assert chunk.token_ids == with_prefill[rid].token_ids, rid
            assert chunk.logprobs == pytest.approx(with_prefill[rid].logprobs, abs=1e-4)


@pytest.mark.parametrize(
    ("family", "overrides", "ignored"),
    [
        ("mistral", {}, "window"),
        ("gemma2", {"attn_logit_softcapping": 0.05}, "softcap"),
        ("gpt_oss", {}, "sinks"),
    ],
)
def test_a_path_that_ignores_what_the_attention_asks_for_is_refused(family, overrides, ignored, monkeypatch):
    """The start-up check has teeth: attention without the sliding window, the soft-cap or the
    sinks gives other logits, on the hand-written layers and on the generic path alike, and the
    model keeps the Hugging Face path."""
    model = tiny_model(family, VOCAB, **overrides)
    with torch.no_grad():  # sharper attention than at init (scores of ~1e-4 would hide a soft-cap)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(50)
    assert isinstance(fast_decoder_for(model, 8, 128), FastDecoder)
    attend = FastDecoder._attend

    def without(self, i, step, q, k, v, scaling, window=None, softcap=None, sinks=None):
        kept = {"window": window, "softcap": softcap, "sinks": sinks}
        kept[ignored] = None
        return attend(self, i, step, q, k, v, scaling, **kept)

    monkeypatch.setattr(FastDecoder, "_attend", without)
    assert fast_decoder_for(model, 8, 128) is None


def test_a_layer_outside_the_attention_hook_keeps_the_hf_path(monkeypatch, caplog):
    """A layer that does not call the attention interface (as a linear-attention or state-space
    layer would not) cannot be served from the cache: refused, with the reason logged."""
    model = tiny_model("mistral", VOCAB)

    def no_interface(*args, **kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        return torch.zeros_like(hidden), None

    monkeypatch.setattr(model.model.layers[1].self_attn, "forward", no_interface)
    with caplog.at_level("INFO", logger="slime.engines.builtin.generic_decoder"):
        assert fast_decoder_for(model, 8, 128) is None
    assert "layers [1] do not call the attention interface" in caplog.text
    assert BuiltinEngine(model).health()["forward"] == "hf"
    with pytest.raises(ValueError, match="fast_path=True"):
        BuiltinEngine(model, fast_path=True)


@pytest.mark.parametrize("family", ["mamba", "qwen3_next"])
def test_a_model_the_hugging_face_path_gets_wrong_is_refused_at_start(family):
    """The Hugging Face path's cache is keys and values: Mamba's state never reached it (every
    decoded token computed without its context, no error) and Qwen3-Next's hybrid layers failed
    inside the first step. Both are refused when the engine starts, naming the cause."""
    model = tiny_model(family, VOCAB, **buildable_families()[family])
    with pytest.raises(ValueError, match=r"cannot serve .* on the Hugging Face path .*; use rollout.engine=vllm"):
        BuiltinEngine(model)


def test_the_hugging_face_path_serves_what_it_computes_right():
    """BLOOM (ALiBi, no fast path) passes the start check; its sampled tokens' logprobs are the
    model's own forward's, rows of unequal prompts included."""
    model = tiny_model("bloom", VOCAB, **buildable_families()["bloom"])
    engine = BuiltinEngine(model, max_running_requests=4)
    assert engine.health()["forward"] == "hf"
    ps = prompts(3, seed=2, lo=2, hi=9)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=[])
    out = engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        got = out[f"r{i}"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + got.token_ids])).logits[0, len(p) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(got.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got.logprobs), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_moe_without_grouped_matmuls_gives_the_models_logits(family):
    """Where `torch._grouped_mm` is missing (CUDA before compute capability 8.0), the routed experts
    run one matmul per expert: plain (Qwen3-MoE) and transposed, biased, clamped and interleaved
    (gpt-oss, through the experts' own activation)."""
    from slime.engines.builtin.start_check import agrees_with_model

    model = tiny_model(family, VOCAB)
    fast = fast_decoder_for(model, 8, 128)
    assert type(fast) is FastDecoder and any(layer.router is not None for layer in fast.layers)
    fast.grouped_mm = False
    assert agrees_with_model(model, fast) is None
