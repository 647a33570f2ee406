"""The built-in rollout engine (slime/engines/builtin/engine.py) on a tiny random Qwen3-MoE, float32, CPU."""

from __future__ import annotations

import copy
import inspect
import random

import numpy as np
import pytest
import torch

from slime.config import TinyModelConfig, load_config
from slime.engines import make_engine
from slime.engines.builtin import BuiltinEngine
from slime.engines.contract import GenerationChunk, GenerationRequest, RolloutEngine, SamplingParams
from slime.engines.sglang.adapter import SglangEngine
from slime.engines.vllm import VllmEngine
from slime.model import build_tiny_moe

VOCAB = 64


def tiny_moe(seed: int) -> torch.nn.Module:
    """The default tiny MoE architecture (slime.model), random init."""
    return build_tiny_moe(TinyModelConfig(), VOCAB, seed).float().eval()


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # robust on a shared 2-core machine


@pytest.fixture(scope="module")
def model():
    return tiny_moe(0)


@pytest.fixture(params=["fast", "generic", "hf"])
def engine(request, model):
    """Every forward path: the hand-written fast decoder (default for this model), the generic one
    (the model's own modules over the cached attention) and Hugging Face's forward."""
    # A copy: weight-update tests write into the engine's model in place.
    fast_path = {"fast": None, "generic": "generic", "hf": False}[request.param]
    eng = BuiltinEngine(copy.deepcopy(model), max_running_requests=16, seed=0, fast_path=fast_path)
    assert eng.health()["forward"] == request.param
    return eng


def prompts(n: int, seed: int = 1, lo: int = 1, hi: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(n: int, stop=()) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=list(stop))


def run_alone(engine: BuiltinEngine, prompt, params, rid="solo", response_ids=()) -> GenerationChunk:
    return engine.generate([GenerationRequest(rid, list(prompt), params, list(response_ids))])[rid]


def drain(engine: BuiltinEngine, out: dict[str, list[int]], finals: dict[str, GenerationChunk] | None = None):
    for c in engine.step():
        out.setdefault(c.request_id, []).extend(c.token_ids)
        if c.finished and finals is not None:
            finals[c.request_id] = c


# ---------------------------------------------------------------------------- batching


@pytest.fixture(params=["fast", "sdpa", "eager"])
def any_attn_engine(request, model):
    """The fast decoder, and Hugging Face's forward with SDPA (4-D decode mask) and eager attention
    (HF builds the masks)."""
    if request.param == "fast":
        return BuiltinEngine(model, max_running_requests=16)
    if request.param == "sdpa":
        return BuiltinEngine(model, max_running_requests=16, fast_path=False)
    eager = tiny_moe(0)
    eager.set_attn_implementation("eager")
    eng = BuiltinEngine(eager, max_running_requests=16, fast_path=False)
    assert not eng._decode_mask_4d
    return eng


def test_greedy_batched_with_staggered_arrival_equals_alone(any_attn_engine):
    engine = any_attn_engine
    ps = prompts(7, seed=3, lo=1, hi=24)
    budgets = [24, 9, 30, 17, 24, 5, 28]
    alone = [run_alone(engine, p, greedy(n)).token_ids for p, n in zip(ps, budgets)]

    out: dict[str, list[int]] = {}
    finals: dict[str, GenerationChunk] = {}
    arrivals = {0: [0, 1], 3: [2], 4: [3, 4], 11: [5], 20: [6]}  # step -> newcomers, mid-decode
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            engine.add_request(GenerationRequest(f"r{i}", ps[i], greedy(budgets[i])))
        drain(engine, out, finals)
        step += 1
    for i, want in enumerate(alone):
        assert out[f"r{i}"] == want, f"request {i} (prompt length {len(ps[i])}) differs when batched"
        assert finals[f"r{i}"].finish_reason == "length" and len(want) == budgets[i]
    h = engine.health()
    assert h["running"] == 0 and h["waiting"] == 0 and h["kv_len"] == 0


def test_cache_is_trimmed_when_long_rows_finish(engine):
    long_p, short_p = prompts(1, seed=5, lo=60, hi=60)[0], prompts(1, seed=6, lo=2, hi=2)[0]
    engine.add_request(GenerationRequest("long", long_p, greedy(1)))
    engine.add_request(GenerationRequest("short", short_p, greedy(20)))
    engine.step()  # both prefilled; "long" finishes on its first token
    assert engine.num_running() == 1
    assert engine.health()["kv_len"] <= len(short_p) + 2  # the 60 columns of padding are gone


def test_max_running_requests_is_respected(model):
    eng = BuiltinEngine(model, max_running_requests=3)
    for i, p in enumerate(prompts(8, seed=7)):
        eng.add_request(GenerationRequest(str(i), p, greedy(4 + i)))
    assert eng.num_waiting() == 8
    done = {}
    while eng.has_unfinished():
        for c in eng.step():
            if c.finished:
                done[c.request_id] = c
        assert eng.num_running() <= 3
    assert sorted(done) == [str(i) for i in range(8)]


# ---------------------------------------------------------------------------- abort / resume


def test_abort_at_random_points_then_resume_equals_uninterrupted(engine):
    ps = prompts(4, seed=11, lo=3, hi=15)
    budget = 24
    full = [run_alone(engine, p, greedy(budget)).token_ids for p in ps]
    rng = random.Random(0)
    for trial in range(3):
        cut = rng.randint(1, budget - 3)  # steps before the abort
        out: dict[str, list[int]] = {}
        for i, p in enumerate(ps):
            engine.add_request(GenerationRequest(f"t{trial}-{i}", p, greedy(budget)))
        for _ in range(cut):
            drain(engine, out)
        aborted = engine.abort([f"t{trial}-0", f"t{trial}-2", "not-there"])
        assert sorted(c.request_id for c in aborted) == [f"t{trial}-0", f"t{trial}-2"]
        assert all(c.finished and c.finish_reason == "abort" and c.token_ids == [] for c in aborted)
        # Resume the aborted ones while the others keep decoding.
        for i in (0, 2):
            have = out[f"t{trial}-{i}"]
            assert have == full[i][: len(have)]
            engine.add_request(GenerationRequest(f"t{trial}-{i}", ps[i], greedy(budget), response_ids=have))
        while engine.has_unfinished():
            drain(engine, out)
        for i in range(4):
            assert out[f"t{trial}-{i}"] == full[i], f"trial {trial}: cut at step {cut}, request {i}"


def test_abort_all_clears_waiting_and_running(model):
    eng = BuiltinEngine(model, max_running_requests=2)
    for i, p in enumerate(prompts(4)):
        eng.add_request(GenerationRequest(str(i), p, greedy(10)))
    eng.step()
    assert eng.num_running() == 2 and eng.num_waiting() == 2
    chunks = eng.abort()
    assert sorted(c.request_id for c in chunks) == ["0", "1", "2", "3"]
    assert not eng.has_unfinished() and eng.abort() == [] and eng.step() == []
    # the ids are free again
    out = eng.generate([GenerationRequest("0", [1, 2, 3], greedy(2))])
    assert len(out["0"].token_ids) == 2


# ---------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (0.7, 5), (0.0, 0)])
def test_logprobs_equal_full_forward(engine, model, temperature, top_k):
    ps = prompts(4, seed=13, lo=2, hi=18)
    params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=12)
    out = engine.generate([GenerationRequest(str(i), p, params) for i, p in enumerate(ps)])
    t = temperature if temperature > 0 else 1.0
    for i, p in enumerate(ps):
        c = out[str(i)]
        assert len(c.token_ids) == len(c.logprobs) == 12
        seq = torch.tensor([p + c.token_ids])
        with torch.inference_mode():
            logits = model(seq).logits[0].float()
        # logits at position j predict token j+1; the full tempered distribution (pre top-k).
        logp = torch.log_softmax(logits[len(p) - 1 : -1] / t, dim=-1)
        want = logp.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)
        if top_k:  # truncation applies to sampling only: every token is among the top k
            rank = (logp > want[:, None]).sum(-1)
            assert int(rank.max()) < top_k


def test_sampling_follows_the_tempered_distribution(model):
    eng = BuiltinEngine(model, max_running_requests=256, seed=5)
    p, n, t = [5, 9, 2], 1024, 0.15  # peaked: top token ~0.28, so a uniform sampler fails
    with torch.inference_mode():
        probs = torch.softmax(model(torch.tensor([p])).logits[0, -1].float() / t, -1)
    params = SamplingParams(temperature=t, max_new_tokens=1)
    out = eng.generate([GenerationRequest(str(i), p, params) for i in range(n)])
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out.values()]), minlength=VOCAB).float()
    sigma = (probs * (1 - probs) / n).sqrt()
    assert bool(((counts / n - probs).abs() <= 5 * sigma + 1e-3).all())


# ---------------------------------------------------------------------------- stopping, truncation


def test_stop_token_included_and_length_reason(engine):
    p = prompts(1, seed=17)[0]
    free = run_alone(engine, p, greedy(20))
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop = free.token_ids[6]
    first = free.token_ids.index(stop)
    stopped = run_alone(engine, p, greedy(20, stop=[stop]))
    assert stopped.token_ids == free.token_ids[: first + 1]  # the stop token is part of the output
    assert stopped.finish_reason == "stop" and stopped.finished
    short = run_alone(engine, p, greedy(3))
    assert short.token_ids == free.token_ids[:3] and short.finish_reason == "length"
    # resume budget: max_new_tokens counts the tokens already generated
    resumed = run_alone(engine, p, greedy(8), response_ids=free.token_ids[:5])
    assert resumed.token_ids == free.token_ids[5:8] and resumed.finish_reason == "length"
    done = run_alone(engine, p, greedy(5), response_ids=free.token_ids[:5])
    assert done.token_ids == [] and done.finish_reason == "length"


def letters(ids) -> str:
    """A toy detokenizer: one letter per token id."""
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_a_stop_string_of_several_tokens_ends_the_response_where_its_text_first_holds_it(engine):
    """The response ends with the token that completes the string in its text (stop_strings),
    in a batch beside a request without one; a response resumed with the string already in it
    finishes at once; without the tokenizer's decode such a request is refused."""
    p = prompts(1, seed=17)[0]
    free = run_alone(engine, p, greedy(24))
    text = letters(free.token_ids)
    stop = text[6:9]
    end = text.index(stop) + len(stop)  # the first occurrence, one letter per token
    engine._decode = letters
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_strings=[stop])
    out: dict[str, list[int]] = {}
    finals: dict[str, GenerationChunk] = {}
    engine.add_request(GenerationRequest("with", p, params))
    engine.add_request(GenerationRequest("without", p, greedy(24)))
    while engine.has_unfinished():
        drain(engine, out, finals)
    assert out["with"] == free.token_ids[:end] and finals["with"].finish_reason == "stop"
    assert out["without"] == free.token_ids and finals["without"].finish_reason == "length"
    resumed = run_alone(engine, p, params, response_ids=free.token_ids[:end])
    assert resumed.token_ids == [] and resumed.finish_reason == "stop"
    engine._decode = None
    with pytest.raises(ValueError, match="stop_strings need the tokenizer's decode"):
        engine.add_request(GenerationRequest("no-decode", p, params))


def test_a_stop_string_of_an_earlier_turn_does_not_end_the_next_one(model):
    """A multi-turn episode's next model turn comes back with the earlier turn (ended by the stop
    string) and the env's observation as response_ids: only a string its own tokens complete ends
    it, not the earlier turn's (it finished at once, or at its first token, with reason stop)."""
    from slime.engines.contract import StopStrings

    stops = StopStrings(["dbc"], letters)
    assert stops.first_end([3, 1, 2, 7, 8, 9], 5) is None  # 'dbc' is already in the text before
    assert stops.first_end([3, 1, 2, 7, 3, 1, 2], 4) == 6  # completed again, by token 6
    assert stops.ends([7, 3, 1, 2]) and not stops.ends([3, 1, 2, 7])
    eng = BuiltinEngine(copy.deepcopy(model), seed=0, decode=letters)
    p = prompts(1, seed=17)[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_strings=["dbc"])
    earlier = [3, 1, 2] + [40, 41, 42]  # turn 1 ended with 'dbc', then a three-token observation
    free = run_alone(eng, p, greedy(24), response_ids=earlier)
    got = run_alone(eng, p, params, response_ids=earlier)
    assert len(got.token_ids) > 1 and got.token_ids == free.token_ids[: len(got.token_ids)]


def test_max_seq_len_truncates(model):
    eng = BuiltinEngine(model, max_seq_len=16)
    p = prompts(1, seed=19, lo=10, hi=10)[0]
    c = run_alone(eng, p, greedy(16))  # the budget is clamped to the room the context leaves
    assert len(c.token_ids) == 6 and c.finish_reason == "length"
    c = run_alone(eng, prompts(1, seed=19, lo=20, hi=20)[0], greedy(16))  # no room at all: no compute
    assert c.token_ids == [] and c.finish_reason == "length"
    with pytest.raises(ValueError, match="max_new_tokens"):  # a budget beyond the model's context
        eng.add_request(GenerationRequest("long", p, greedy(17)))


# ---------------------------------------------------------------------------- sampling


def test_top_k_one_and_tiny_top_p_equal_greedy(engine):
    ps = prompts(3, seed=23)
    want = {str(i): run_alone(engine, p, greedy(15)).token_ids for i, p in enumerate(ps)}
    for params in (
        SamplingParams(temperature=1.0, top_k=1, max_new_tokens=15),
        SamplingParams(temperature=1.3, top_p=1e-6, max_new_tokens=15),
    ):
        out = engine.generate([GenerationRequest(str(i), p, params) for i, p in enumerate(ps)])
        assert {k: c.token_ids for k, c in out.items()} == want


def test_mixed_params_in_one_batch(engine):
    ps = prompts(3, seed=29)
    g = run_alone(engine, ps[0], greedy(10)).token_ids
    out = engine.generate(
        [
            GenerationRequest("g", ps[0], greedy(10)),
            GenerationRequest("s", ps[1], SamplingParams(temperature=1.0, max_new_tokens=10)),
            GenerationRequest("k", ps[2], SamplingParams(temperature=0.8, top_k=3, top_p=0.9, max_new_tokens=10)),
        ]
    )
    assert out["g"].token_ids == g
    assert all(len(c.token_ids) == 10 for c in out.values())


def test_seed_makes_sampling_reproducible(model):
    ps = prompts(4, seed=31)

    def sample(seed):
        eng = BuiltinEngine(model, seed=seed)
        params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16)
        out = eng.generate([GenerationRequest(str(i), p, params) for i, p in enumerate(ps)])
        return [out[str(i)].token_ids for i in range(len(ps))]

    a, b, c = sample(7), sample(7), sample(8)
    assert a == b
    assert a != c


def test_a_request_with_a_seed_of_its_own_samples_the_same_tokens_whatever_runs_beside_it(engine):
    """SamplingParams.seed (held-out eval): the same tokens alone, in a batch of other requests
    (with and without seeds), on an engine of another seed; another seed gives other tokens."""
    ps = prompts(5, seed=41)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=123)
    free = SamplingParams(temperature=1.0, max_new_tokens=16)
    alone = run_alone(engine, ps[0], seeded).token_ids
    fast_path = {"fast": None, "generic": "generic", "hf": False}[engine.health()["forward"]]
    other_engine = BuiltinEngine(engine.model, seed=99, fast_path=fast_path)
    batch = [GenerationRequest("seeded", ps[0], seeded)]
    batch += [GenerationRequest(f"free{i}", p, free) for i, p in enumerate(ps[1:3])]
    batch += [GenerationRequest(f"other{i}", p, copy.copy(seeded)) for i, p in enumerate(ps[3:])]
    out = other_engine.generate(batch)
    assert out["seeded"].token_ids == alone
    reseeded = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=124)
    assert run_alone(engine, ps[0], reseeded).token_ids != alone


# ---------------------------------------------------------------------------- weights


def test_update_weights_switches_to_new_model_in_place(engine):
    other = tiny_moe(1)
    ps = prompts(3, seed=37)
    ref = BuiltinEngine(other)
    want = {str(i): run_alone(ref, p, greedy(12)).token_ids for i, p in enumerate(ps)}
    before = {str(i): run_alone(engine, p, greedy(12)).token_ids for i, p in enumerate(ps)}
    assert before != want
    ptrs = {n: t.data_ptr() for n, t in engine.model.named_parameters()}
    engine.update_weights(3, other.state_dict().items())
    assert engine.version == 3 and engine.health()["version"] == 3
    assert ptrs == {n: t.data_ptr() for n, t in engine.model.named_parameters()}  # no re-allocation
    out = engine.generate([GenerationRequest(str(i), p, greedy(12)) for i, p in enumerate(ps)])
    assert {k: c.token_ids for k, c in out.items()} == want
    assert all(c.version == 3 for c in out.values())


def test_update_weights_while_running(engine):
    other = tiny_moe(2)
    engine.add_request(GenerationRequest("a", prompts(1)[0], greedy(10)))
    versions = []
    for _ in range(3):
        versions += [c.version for c in engine.step()]
    engine.update_weights(1, other.named_parameters())
    while engine.has_unfinished():
        versions += [c.version for c in engine.step()]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)


def test_update_weights_rejects_bad_name_and_shape(engine):
    with pytest.raises(ValueError, match="model.layers.0.bogus"):
        engine.update_weights(1, [("model.layers.0.bogus", torch.zeros(3))])
    name = "model.embed_tokens.weight"
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        engine.update_weights(1, [(name, torch.zeros(3, 3))])
    assert engine.version == 0


# ---------------------------------------------------------------------------- boundary


def test_request_validation(engine):
    engine.add_request(GenerationRequest("dup", [1, 2], greedy(2)))
    with pytest.raises(ValueError, match="dup"):
        engine.add_request(GenerationRequest("dup", [1, 2], greedy(2)))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request(GenerationRequest("x", [1, VOCAB], greedy(2)))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(GenerationRequest("y", [], greedy(2)))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request(GenerationRequest("z", [1], SamplingParams(top_p=0.0)))
    with pytest.raises(RuntimeError):
        engine.generate([GenerationRequest("w", [1], greedy(2))])
    engine.abort()


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", -0.1),
        ("temperature", 100.5),
        ("temperature", 1e-45),  # logits / temperature overflowed: NaN probabilities, token 0
        ("temperature", "0.5"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_p", None),
        ("top_k", 10**30),
        ("top_k", 1e30),
        ("top_k", VOCAB + 1),
        ("top_k", -1),
        ("top_k", 2.0),
        ("top_k", True),
        ("max_new_tokens", -1),
        ("max_new_tokens", 1 << 40),
        ("max_new_tokens", 3.0),
        ("max_new_tokens", False),
        ("stop_token_ids", [VOCAB]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", list(range(VOCAB)) * 5),
        ("stop_token_ids", 3),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.5),
    ],
)
def test_bad_sampling_values_are_refused_naming_the_field(model, field, value):
    """Every bound of validate_sampling, through add_request: a ValueError naming the field, nothing
    queued, and the engine serves the next request."""
    eng = BuiltinEngine(model, max_running_requests=2, max_seq_len=128)
    params = SamplingParams(temperature=0.7, max_new_tokens=4)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=field):
        eng.add_request(GenerationRequest("bad", [1, 2], params))
    assert not eng.has_unfinished()
    assert len(run_alone(eng, [1, 2], greedy(3), rid="bad").token_ids) == 3


def test_bad_token_ids_are_refused_naming_the_field(model):
    eng = BuiltinEngine(model, max_running_requests=2)
    for prompt, response, field in (
        ([1, 2.0], [], "prompt_ids"),
        ([1, True], [], "prompt_ids"),
        ([1], [VOCAB], "response_ids"),
        ([1], ["3"], "response_ids"),
    ):
        with pytest.raises(ValueError, match=field):
            eng.add_request(GenerationRequest("bad", prompt, greedy(2), response))
    # numpy ids and integer scalars are token ids (the rollout worker keeps them in arrays)
    c = run_alone(
        eng, np.array([1, 2, 3]), SamplingParams(temperature=0.0, top_k=np.int64(3), max_new_tokens=np.int32(2))
    )
    assert len(c.token_ids) == 2


# ---------------------------------------------------------------------------- the contract

CONTRACT = sorted(name for name in vars(RolloutEngine) if not name.startswith("_"))


@pytest.mark.parametrize("engine_class", [BuiltinEngine, VllmEngine, SglangEngine], ids=lambda c: c.__name__)
def test_every_engine_class_implements_the_contract(engine_class):
    """Every member of `RolloutEngine`, with its parameter names, and the shared `from_config`
    (the vLLM and SGLang adapters import without their packages)."""
    assert CONTRACT == [
        "abort",
        "add_request",
        "close",
        "forget",
        "has_unfinished",
        "health",
        "num_running",
        "num_waiting",
        "release_memory",
        "resume_memory",
        "score_logprobs",
        "set_temperature",
        "step",
        "update_weights",
        "version",
        "weight_checksums",
    ]
    for name in CONTRACT:
        want, got = getattr(RolloutEngine, name), getattr(engine_class, name, None)
        assert got is not None, f"{engine_class.__name__} has no {name}"
        if isinstance(want, property):
            assert isinstance(got, property), name
        else:
            assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), name
    assert list(inspect.signature(engine_class.from_config).parameters) == [
        "cfg",
        "model_dir",
        "index",
        "version",
        "api_token",
    ]


def test_make_engine_builds_the_configured_builtin_engine(tiny_model_dir, tmp_path):
    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            f"model.path={tiny_model_dir}",
            "rollout.max_running_requests=3",
            "rollout.kept_kv_tokens=100",
        ],
    )
    engine = make_engine(cfg, str(tiny_model_dir), 1, 5)
    assert isinstance(engine, BuiltinEngine) and engine.version == 5
    assert engine.max_running_requests == 3 and engine.kept_kv_tokens == 100
    out = engine.generate([GenerationRequest("r", [1, 2, 3], greedy(4))])["r"]
    assert len(out.token_ids) == 4 and out.version == 5
    engine.close()


def test_an_engine_started_later_does_not_repeat_the_first_steps_draws(tiny_model_dir, tmp_path):
    """The sampler is seeded from the job's seed, the worker index and the policy version the engine
    starts at: a fresh job draws as before, a resumed job or a restarted worker (version > 0) draws a
    stream of its own instead of step 0's again."""
    cfg = load_config(None, [f"output_dir={tmp_path}", f"model.path={tiny_model_dir}"])
    sampled = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=[])

    def draws(version: int) -> list[int]:
        engine = make_engine(cfg, str(tiny_model_dir), 0, version)
        tokens = engine.generate([GenerationRequest("r", [1, 2, 3], sampled)])["r"].token_ids
        engine.close()
        return tokens

    assert draws(0) == draws(0)  # reproducible
    assert draws(0) != draws(4)


def test_the_config_and_the_engines_take_the_same_temperatures():
    from slime.config import load_config
    from slime.config.rollout import MIN_TEMPERATURE
    from slime.engines.contract import MIN_TEMPERATURE as ENGINE_MIN_TEMPERATURE

    assert MIN_TEMPERATURE == ENGINE_MIN_TEMPERATURE
    with pytest.raises(ValueError, match="rollout.temperature: must be 0 .greedy. or at least"):
        load_config(None, ["rollout.temperature=1e-45"])
    assert load_config(None, ["rollout.temperature=0"]).rollout.temperature == 0


def test_only_the_turns_own_tokens_can_have_stopped_it(model):
    """A multi-turn response ends in an observation; one that ends in a stop token is not a turn
    that stopped. With turn_start at the observation's end the next turn generates; without it
    (a resumed single-turn partial) the same tokens mean "stopped already"."""
    eng = BuiltinEngine(model, max_running_requests=2, max_seq_len=128)
    response = [9, 10, 11, 5]  # ..., then the observation's last token, 5, which is a stop token here
    params = greedy(12, stop=[5])
    stopped = eng.generate([GenerationRequest("resumed", [1, 2], params, response)])["resumed"]
    assert (stopped.token_ids, stopped.finish_reason) == ([], "stop")
    turn = eng.generate([GenerationRequest("next-turn", [1, 2], params, response, turn_start=4)])["next-turn"]
    assert turn.token_ids and turn.finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="turn_start must be an integer in \\[0, 4\\]"):
        eng.add_request(GenerationRequest("bad", [1, 2], params, response, turn_start=5))
