"""The built-in engine's fast forward (slime/engines/builtin/fast_decoder.py) against Hugging Face's forward."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from benchmarks.multiturn_kv import run_turns
from slime.config import TinyModelConfig
from slime.engines.builtin import BuiltinEngine
from slime.engines.builtin import fast_decoder as fd
from slime.engines.builtin.fast_decoder import SEGMENT_ROWS, FastDecoder, decode_segments
from slime.engines.builtin.generic_decoder import fast_decoder_for
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.engines.expert_load import ExpertLoadRecorder
from slime.model import build_tiny_moe

VOCAB = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # robust on a shared 2-core machine


def tiny_moe(seed: int = 0) -> torch.nn.Module:
    return build_tiny_moe(TinyModelConfig(), VOCAB, seed).float().eval()


def tiny_dense(kind: str) -> torch.nn.Module:
    """A small dense Llama / Qwen2 (q/k/v bias) / Qwen3 (q/k norm), random init."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()


def prompts(n: int, seed: int, lo: int = 1, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(engine: BuiltinEngine, ps, params_of, rid="r"):
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
    fast = BuiltinEngine(model, max_running_requests=32)
    hf = BuiltinEngine(model, max_running_requests=32, fast_path=False)
    assert fast.health()["forward"] == "fast" and hf.health()["forward"] == "hf"
    ps = prompts(20, seed=1)
    budgets = [random.Random(i).randint(1, 40) for i in range(20)]

    def greedy(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_new_tokens=budgets[i])

    got, want = run(fast, ps, greedy), run(hf, ps, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for c, w in zip(got, want):
        assert c.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_sampled_logprobs_equal_the_model_forward_through_growth_and_compaction():
    """Rows finish at different steps (holes filled from the tail), more rows and longer contexts
    than the first cache allocation (8 rows, 64 positions): every reported logprob must still be
    the model's own tempered logprob of that token."""
    model = tiny_moe(3)
    engine = BuiltinEngine(model, max_running_requests=40, seed=5)
    ps = prompts(30, seed=2, lo=1, hi=60)
    rng = random.Random(0)
    params = [
        SamplingParams(temperature=0.7, top_k=rng.choice([0, 10]), max_new_tokens=rng.randint(1, 150)) for _ in ps
    ]
    chunks = run(engine, ps, lambda i: params[i])
    assert max(len(p) + len(c.token_ids) for p, c in zip(ps, chunks)) > 128
    for p, c, sp in zip(ps, chunks, params):
        assert len(c.token_ids) == sp.max_new_tokens
        assert c.logprobs == pytest.approx(reference_logprobs(model, p, c.token_ids, 0.7), abs=2e-4)


def test_staggered_arrivals_aborts_and_resume_equal_running_alone():
    model = tiny_moe(1)
    engine = BuiltinEngine(model, max_running_requests=6)
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
    engine = BuiltinEngine(model, max_running_requests=8)
    reference = BuiltinEngine(other, max_running_requests=8, fast_path=False)
    ps = prompts(4, seed=9)

    def greedy(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_new_tokens=20)

    before = [c.token_ids for c in run(engine, ps, greedy)]
    engine.update_weights(1, other.state_dict().items())
    after = [c.token_ids for c in run(engine, ps, greedy)]
    assert after == [c.token_ids for c in run(reference, ps, greedy)]
    assert after != before


def test_router_hooks_still_fire_for_the_expert_load_recorder():
    model = tiny_moe(0)
    engine = BuiltinEngine(model, max_running_requests=8)
    recorder = ExpertLoadRecorder.attach(model)
    ps = prompts(3, seed=11, lo=5, hi=5)
    run(engine, ps, lambda i: SamplingParams(temperature=0.0, max_new_tokens=10))
    counts = recorder.take()
    cfg = TinyModelConfig()
    # Each layer routes every fed token to top-k experts: 15 prompt tokens + 3 x 9 decode inputs.
    assert counts.shape == (cfg.num_layers, cfg.num_experts)
    assert (counts.sum(1) == (15 + 27) * cfg.experts_per_token).all()
    recorder.detach()


def test_gpt2_takes_the_hand_written_layers_and_every_path_gives_the_hf_paths_tokens():
    """GPT-2 (learned positions, fused Conv1D q/k/v, GELU) is none of the curated families: its
    parts are found by structure and it takes the hand-written layers; the generic path (its own
    modules over the cached attention) and the Hugging Face path give the same greedy tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()
    engines = [BuiltinEngine(gpt2, max_running_requests=8, fast_path=path) for path in (None, "generic", False)]
    assert [e.health()["forward"] for e in engines] == ["fast", "generic", "hf"]
    ps = prompts(6, seed=4, hi=20)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    fast, generic, hf = ([c.token_ids for c in run(e, ps, lambda i: greedy)] for e in engines)
    assert fast == generic == hf


def test_a_model_whose_numbers_differ_from_the_hand_written_path_takes_the_generic_one():
    """A forward hook that changes an MLP's output is invisible to the hand-written forward: the
    start-up check compares logits and refuses it; the generic path runs the model's own modules,
    hooks included, and agrees."""
    model = tiny_moe(0)
    assert type(fast_decoder_for(model, 8, 128)) is FastDecoder
    model.model.layers[1].mlp.register_forward_hook(lambda module, inputs, output: output * 1.5)
    assert type(fast_decoder_for(model, 8, 128)).__name__ == "GenericDecoder"
    assert BuiltinEngine(model).health()["forward"] == "generic"


# ---------------------------------------------------------------- kept KV of aborted requests


def _drive(engine: BuiltinEngine, got: dict[str, list[int]], lps: dict[str, list[float]], steps: int | None = None):
    n = 0
    while engine.has_unfinished() and (steps is None or n < steps):
        for c in engine.step():
            got.setdefault(c.request_id, []).extend(c.token_ids)
            lps.setdefault(c.request_id, []).extend(c.logprobs)
        n += 1


def test_aborted_requests_resume_from_their_kept_cache_token_exact():
    """Abort everything at several points; resumed with the stored tokens, each request rejoins from
    its kept cache (no prefill: the counters say so) and ends exactly as an uninterrupted run."""
    model = tiny_moe(2)
    ps = prompts(8, seed=12, lo=2, hi=20)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    alone = BuiltinEngine(model, max_running_requests=8)
    want = {f"q{i}": c.token_ids for i, c in enumerate(run(alone, ps, lambda i: greedy, rid="q"))}

    engine = BuiltinEngine(model, max_running_requests=8, kept_kv_tokens=10_000)
    got: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    for i, p in enumerate(ps):
        engine.add_request(GenerationRequest(f"q{i}", p, greedy))
    context_tokens = 0
    for cut in (3, 7, 1, 11):
        _drive(engine, got, lps, steps=cut)
        aborted = [c.request_id for c in engine.abort(None)]
        assert aborted
        for rid in aborted:
            i = int(rid[1:])
            context_tokens += len(ps[i]) + len(got[rid]) - 1
            engine.add_request(GenerationRequest(rid, ps[i], greedy, list(got[rid])))
        before = engine.health()["kv_resumes"]
        engine.step()  # admission: all of them from their caches
        assert engine.health()["kv_resumes"] == before + len(aborted)
        engine.abort(None)  # once more, with nothing decoded in between
        for rid in aborted:
            engine.add_request(GenerationRequest(rid, ps[int(rid[1:])], greedy, list(got[rid])))
    _drive(engine, got, lps)
    assert got == want
    assert engine.health()["kv_resumed_tokens"] >= context_tokens


def test_released_memory_comes_back_and_aborted_requests_resume_token_exact():
    """Colocated placement: after an abort the engine frees its slot cache and the kept caches while
    the learner trains; the partials resume by prefill, exactly as an uninterrupted run."""
    model = tiny_moe(2)
    ps = prompts(6, seed=5, lo=2, hi=16)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30)
    want = {
        f"q{i}": c.token_ids
        for i, c in enumerate(run(BuiltinEngine(model, max_running_requests=6), ps, lambda i: greedy, rid="q"))
    }

    engine = BuiltinEngine(model, max_running_requests=6, kept_kv_tokens=10_000)
    got: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    for i, p in enumerate(ps):
        engine.add_request(GenerationRequest(f"q{i}", p, greedy))
    for cut in (4, 9):
        _drive(engine, got, lps, steps=cut)
        aborted = [c.request_id for c in engine.abort(None)]
        cache = engine._batch.keys[0]
        freed = engine.release_memory()
        # The slot cache (keys and values of every layer) and each aborted request's kept cache.
        assert freed >= 2 * len(engine._batch.layers) * cache.numel() * cache.element_size()
        assert engine._batch.keys == [] and engine.health()["kv_kept_requests"] == 0
        for rid in aborted:
            engine.add_request(GenerationRequest(rid, ps[int(rid[1:])], greedy, list(got[rid])))
    _drive(engine, got, lps)
    assert got == want
    assert engine.health()["kv_resumes"] == 0 and engine.health()["memory_releases"] == 2


def test_sampled_logprobs_after_a_kept_cache_resume_are_the_models():
    model = tiny_moe(4)
    engine = BuiltinEngine(model, max_running_requests=16, seed=3, kept_kv_tokens=10_000)
    ps = prompts(12, seed=13, lo=1, hi=30)
    params = SamplingParams(temperature=0.8, max_new_tokens=60)
    got: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    for i, p in enumerate(ps):
        engine.add_request(GenerationRequest(f"s{i}", p, params))
    _drive(engine, got, lps, steps=9)
    for c in engine.abort(None):
        engine.add_request(GenerationRequest(c.request_id, ps[int(c.request_id[1:])], params, list(got[c.request_id])))
    _drive(engine, got, lps)
    assert engine.health()["kv_resumes"] == 12
    for i, p in enumerate(ps):
        rid = f"s{i}"
        assert len(got[rid]) == 60
        assert lps[rid] == pytest.approx(reference_logprobs(model, p, got[rid], 0.8), abs=2e-4)


def test_other_tokens_or_an_evicted_cache_mean_a_prefill_from_token_ids():
    model = tiny_moe(5)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30)
    ps = prompts(3, seed=14, lo=5, hi=10)
    engine = BuiltinEngine(model, max_running_requests=4, kept_kv_tokens=10_000)
    got: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    for i, p in enumerate(ps):
        engine.add_request(GenerationRequest(f"r{i}", p, greedy))
    _drive(engine, got, lps, steps=5)
    engine.abort(None)
    # r0 comes back with one token fewer (a caller that lost its last chunk): its cache is for other
    # tokens, so it is prefilled from the token ids it brings and continues from there.
    shorter = got["r0"][:-1]
    engine.add_request(GenerationRequest("r0", ps[0], greedy, shorter))
    rest: dict[str, list[int]] = {}
    _drive(engine, rest, {}, steps=1)
    assert engine.health()["kv_resumes"] == 0
    assert "r0" not in engine._kept  # its cache, computed for other tokens, is gone
    _drive(engine, rest, {})
    alone = BuiltinEngine(model, max_running_requests=4, fast_path=False)
    assert shorter + rest["r0"] == run(alone, [ps[0]], lambda i: greedy)[0].token_ids

    # A budget smaller than what was aborted keeps only the most recent caches.
    got, lps = {}, {}
    budget = len(ps[2]) + 5  # r2's prompt + the 5 tokens of 5 steps
    small = BuiltinEngine(model, max_running_requests=4, kept_kv_tokens=budget)
    for i, p in enumerate(ps):
        small.add_request(GenerationRequest(f"r{i}", p, greedy))
    _drive(small, got, lps, steps=5)
    assert len(got["r2"]) == 5
    small.abort(["r0", "r1"])
    small.abort(["r2"])
    assert list(small._kept) == ["r2"]
    assert small._kept_len == len(ps[2]) + len(got["r2"])


def test_kept_cache_across_a_weight_update_equals_running_through_it():
    """A request aborted, then resumed after an update from its kept cache, is numerically the
    request that ran through the same update without being aborted (old keys/values, new weights)."""
    model_a, model_b, new = tiny_moe(0), tiny_moe(0), tiny_moe(9)
    ps = prompts(5, seed=15, lo=3, hi=15)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30)
    through = BuiltinEngine(model_a, max_running_requests=8)
    parked = BuiltinEngine(model_b, max_running_requests=8, kept_kv_tokens=10_000)
    got_t, lps_t, got_p, lps_p = {}, {}, {}, {}
    for e in (through, parked):
        for i, p in enumerate(ps):
            e.add_request(GenerationRequest(f"u{i}", p, greedy))
    _drive(through, got_t, lps_t, steps=6)
    _drive(parked, got_p, lps_p, steps=6)
    for c in parked.abort(None):
        parked.add_request(
            GenerationRequest(c.request_id, ps[int(c.request_id[1:])], greedy, list(got_p[c.request_id]))
        )
    for e in (through, parked):
        e.update_weights(1, new.state_dict().items())
    _drive(through, got_t, lps_t)
    _drive(parked, got_p, lps_p)
    assert parked.health()["kv_resumes"] == 5
    assert got_p == got_t
    for rid in got_t:
        assert lps_p[rid] == pytest.approx(lps_t[rid], abs=1e-5)


@pytest.mark.parametrize("block", ["one", "many"])
def test_a_finished_turn_kept_for_the_next_feeds_only_the_observation(block, monkeypatch):
    """Multi-turn: a model turn that asks for it (keep_kv_after_finish) leaves its cache; the next
    turn, the same request with the turn's tokens and an observation after them, feeds only the
    observation onto it (in query blocks, 'many', as a long observation would be). Greedy rows give
    the tokens and logprobs of an engine that prefills every turn; sampled rows the model's logprobs."""
    if block == "many":
        monkeypatch.setattr(fd, "EXTENSION_SCORES", 4 * 8)  # 4 heads: 2 queries per block at <= 4 keys
    model = tiny_moe(6)
    ps = prompts(5, seed=21, lo=3, hi=12)
    rng = random.Random(2)
    temperatures = [0.0 if i < 3 else 0.8 for i in range(len(ps))]
    observations = [[[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 9))] for _ in ps] for _ in range(2)]
    budgets = [5, 8, 6]
    kept = BuiltinEngine(model, max_running_requests=8, seed=4, kept_kv_tokens=10_000)
    prefilled = BuiltinEngine(model, max_running_requests=8, seed=4)
    with_kept = run_turns(kept, ps, temperatures, observations, budgets)
    with_prefill = run_turns(prefilled, ps, temperatures, observations, budgets)
    resumed_tokens = 0
    for turn, ((got, contexts), (want, _)) in enumerate(zip(with_kept, with_prefill)):
        for rid, context in contexts.items():
            if temperatures[int(rid[1:])] == 0:
                assert got[rid].token_ids == want[rid].token_ids, (turn, rid)
                assert got[rid].logprobs == pytest.approx(want[rid].logprobs, abs=1e-5)
            else:
                assert len(got[rid].token_ids) == budgets[turn]
                assert got[rid].logprobs == pytest.approx(
                    reference_logprobs(model, context, got[rid].token_ids, 0.8), abs=2e-4
                )
            if turn:  # the cache held every token before the last one of the previous turn
                resumed_tokens += len(context) - len(observations[turn - 1][int(rid[1:])]) - 1
    health = kept.health()
    assert health["kv_resumes"] == 2 * len(ps) and health["kv_resumed_tokens"] == resumed_tokens
    assert prefilled.health()["kv_resumes"] == 0


def test_a_finished_request_that_did_not_ask_keeps_no_cache_and_other_tokens_mean_a_prefill():
    model = tiny_moe(7)
    p = prompts(1, seed=22, lo=4, hi=8)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=[])
    engine = BuiltinEngine(model, max_running_requests=4, kept_kv_tokens=10_000)
    first = engine.generate([GenerationRequest("a", p, greedy)])["a"].token_ids
    assert engine.health()["kv_kept_requests"] == 0  # single-turn: nothing kept
    first = engine.generate([GenerationRequest("b", p, greedy, keep_kv_after_finish=True)])["b"].token_ids
    assert engine.health()["kv_kept_requests"] == 1
    # Back with its last token changed (not what the cache was computed for): prefilled from the ids.
    other = first[:-1] + [(first[-1] + 1) % VOCAB]
    again = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[])
    got = engine.generate([GenerationRequest("b", p, again, other + [5, 6])])["b"].token_ids
    assert engine.health()["kv_resumes"] == 0 and engine.health()["kv_kept_requests"] == 0
    alone = BuiltinEngine(model, max_running_requests=4)
    assert got == alone.generate([GenerationRequest("b", p, again, other + [5, 6])])["b"].token_ids
    # forget: the caller sends the request no more (its episode ended); unknown ids are ignored.
    engine.generate([GenerationRequest("c", p, greedy, keep_kv_after_finish=True)])
    assert engine.health()["kv_kept_requests"] == 1
    engine.forget(["c", "never-seen"])
    assert engine.health()["kv_kept_requests"] == 0 and engine._kept_len == 0


# ---------------------------------------------------------------- segmented decode attention


def test_decode_segments_cover_every_row_and_split_only_where_it_pays():
    long_then_short = np.array([90] * SEGMENT_ROWS + [5] * (3 * SEGMENT_ROWS))
    assert decode_segments(long_then_short) == [(0, SEGMENT_ROWS, 91), (SEGMENT_ROWS, 4 * SEGMENT_ROWS, 6)]
    assert decode_segments(np.full(70, 40)) == [(0, 70, 41)]  # equal rows: one segment
    assert decode_segments(np.array([7])) == [(0, 1, 8)]
    rng = np.random.default_rng(0)
    for _ in range(50):
        lens = rng.integers(1, 200, size=int(rng.integers(1, 120)))
        segments = decode_segments(lens)
        assert segments[0][0] == 0 and segments[-1][1] == len(lens)
        assert all(a[1] == b[0] for a, b in zip(segments, segments[1:]))
        assert all(used == lens[r0:r1].max() + 1 for r0, r1, used in segments)


def test_segmented_decode_attention_equals_one_padded_attention(monkeypatch):
    """APRIL's batches: a few long resumed rows before many short fresh ones. Each segment attends
    only up to its own longest row; the logits must equal one attention padded to the longest."""
    model = tiny_moe(4)
    contexts = prompts(16, seed=21, lo=80, hi=110) + prompts(40, seed=22, lo=2, hi=8)
    steps = [torch.randint(2, VOCAB, (len(contexts),), generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def decode_all() -> list[torch.Tensor]:
        fast = FastDecoder(model, 64, 256)
        with torch.inference_mode():
            out = [fast.prefill(contexts)]
            out += [fast.decode(tokens) for tokens in steps]
        return out

    assert len(fd.decode_segments(np.array([len(c) for c in contexts]))) > 1
    segmented = decode_all()
    monkeypatch.setattr(fd, "SEGMENT_COST", 10**9)  # never split: one padded attention
    padded = decode_all()
    for a, b in zip(segmented, padded):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_groups_shared_prompt_is_prefilled_once_and_each_sample_decodes_on_its_own():
    """GRPO's n samples of a prompt arrive together with identical contexts: the prompt is fed
    once; every row gets its keys/values, and greedy/sampled tokens match running each alone."""
    model = tiny_moe(5)
    prompt_a, prompt_b = prompts(2, seed=31, lo=6, hi=12)
    contexts = [prompt_a] * 4 + [prompt_b] * 3 + [prompt_a[:-1]]
    fast = FastDecoder(model, 16, 128)
    with torch.inference_mode():
        logits = fast.prefill(contexts)
        steps = torch.randint(2, VOCAB, (len(contexts),), generator=torch.Generator().manual_seed(3))
        decoded = fast.decode(steps)
    assert fast.shared_prefill_tokens == 3 * len(prompt_a) + 2 * len(prompt_b)
    for r, context in enumerate(contexts):
        ref = model(input_ids=torch.tensor([context + [int(steps[r])]]), use_cache=False).logits[0].float()
        torch.testing.assert_close(logits[r], ref[len(context) - 1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(decoded[r], ref[len(context)], rtol=1e-4, atol=1e-4)

    engine = BuiltinEngine(model, max_running_requests=16)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    together = run(engine, [prompt_a] * 4, lambda i: greedy)
    assert engine.health()["shared_prefill_tokens"] == 3 * len(prompt_a)
    alone = run(BuiltinEngine(model, max_running_requests=16), [prompt_a], lambda i: greedy)[0]
    assert all(c.token_ids == alone.token_ids for c in together)
    sampled = run(engine, [prompt_a] * 4, lambda i: SamplingParams(temperature=1.0, max_new_tokens=12), rid="s")
    assert len({tuple(c.token_ids) for c in sampled}) > 1  # one shared prefill, independent samples
