"""Static decode steps (slime/engines/builtin/decode_graphs.py): buckets, padding and static buffers on CPU,
where the steps run eagerly; the same steps are what a CUDA graph captures. Greedy tokens must equal
the segmented decode's, through weight updates, cache growth, rows leaving and routing recorders.
Also the start check's like-with-like routing (fast_decoder.agrees_with_model)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from benchmarks.families import tiny_model
from slime.engines.builtin import BuiltinEngine, generic_decoder
from slime.engines.builtin.decode_graphs import MIN_LENGTH_BUCKET, batch_buckets, bucket_for, length_bucket
from slime.engines.builtin.fast_decoder import FastDecoder, grouped_mm_agrees
from slime.engines.builtin.generic_decoder import GenericDecoder, fast_decoder_for
from slime.engines.builtin.start_check import agrees_with_model
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.engines.expert_load import ExpertLoadRecorder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 97


def test_batch_and_length_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(1) == [1]
    assert [bucket_for(n, batch_buckets(48)) for n in (1, 3, 17, 33, 48)] == [1, 4, 32, 48, 48]
    with pytest.raises(ValueError, match="exceed"):
        bucket_for(49, batch_buckets(48))
    assert length_bucket(1, 4096) == MIN_LENGTH_BUCKET
    assert length_bucket(65, 4096) == 128 and length_bucket(128, 4096) == 128
    assert length_bucket(129, 200) == 200  # capped at the cache's length
    assert length_bucket(300, 200) == 300  # never shorter than what the rows need


def requests(n: int, seed: int, max_new: int, greedy: bool = True) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(
            temperature=0.0 if greedy else 1.0, max_new_tokens=rng.randint(1, max_new), stop_token_ids=[]
        )
        out.append(GenerationRequest(f"r{i}", prompt, params))
    return out


def generate(engine: BuiltinEngine, reqs: list[GenerationRequest]) -> dict[str, tuple[list[int], list[float]]]:
    out = engine.generate(copy.deepcopy(reqs))
    return {rid: (c.token_ids, c.logprobs) for rid, c in out.items()}


@pytest.mark.parametrize(
    "family",
    ["qwen3_moe", "llama", "gemma2", "deepseek_v3", "gpt_oss", "olmo2", "granitemoe", "gpt2", "gpt_neox", "codegen"],
)
def test_static_decode_greedy_equals_segmented(family):
    """Rows of unequal lengths finishing at different steps (the batch bucket shrinks), a cache that
    grows past the first length bucket (shapes dropped and rebuilt): the same tokens."""
    model = tiny_model(family, VOCAB)
    reqs = requests(11, seed=3, max_new=80)
    static = BuiltinEngine(model, max_running_requests=16, cuda_graphs=True)
    plain = BuiltinEngine(model, max_running_requests=16, cuda_graphs=False)
    assert static.health()["forward"] == "fast" and static.health()["static_decode"]
    assert not static.health()["cuda_graphs"]  # CPU: the static steps run eagerly
    decode = static._batch.static_decode
    shapes, new_shape = [], decode._new_shape
    decode._new_shape = lambda rows, length: shapes.append((rows, length)) or new_shape(rows, length)
    got, want = generate(static, reqs), generate(plain, reqs)
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        assert got[rid][1] == pytest.approx(want[rid][1], abs=1e-4)
    assert static.health()["static_decode_steps"] > 60
    assert {rows for rows, _ in shapes} >= {16, 8}  # the bucket followed the rows down
    assert max(length for _, length in shapes) >= 2 * MIN_LENGTH_BUCKET


def test_static_decode_sees_weight_updates_in_place():
    a, b = tiny_model("qwen3_moe", VOCAB, seed=0), tiny_model("qwen3_moe", VOCAB, seed=1)
    reqs = requests(6, seed=5, max_new=20)
    engine = BuiltinEngine(copy.deepcopy(a), max_running_requests=8, cuda_graphs=True)
    first = generate(engine, reqs)
    engine.update_weights(1, list(b.state_dict().items()))
    after = generate(engine, reqs)
    fresh = generate(BuiltinEngine(b, max_running_requests=8, cuda_graphs=False), reqs)
    for rid, (tokens, logprobs) in fresh.items():
        assert after[rid][0] == tokens
        assert after[rid][1] == pytest.approx(logprobs, abs=1e-4)
    assert [after[rid][0] for rid in fresh] != [first[rid][0] for rid in fresh]


def test_routing_and_expert_load_recorders_see_static_steps():
    model = tiny_model("qwen3_moe", VOCAB)
    reqs = requests(5, seed=9, max_new=12)
    loads, routings = [], []
    for graphs in (True, False):
        engine = BuiltinEngine(model, max_running_requests=8, cuda_graphs=graphs, record_routing=True)
        recorder = ExpertLoadRecorder.attach(model)
        out = engine.generate(copy.deepcopy(reqs))
        loads.append(recorder.take())
        recorder.detach()
        engine._batch.routing_recorder.handles[0].remove()
        for h in engine._batch.routing_recorder.handles[1:]:
            h.remove()
        routings.append({rid: c.routing for rid, c in out.items()})
    assert routings[0] == routings[1]
    assert (loads[0] == loads[1]).all() and loads[0].sum() > 0


def test_a_hook_on_another_module_turns_the_step_eager():
    model = tiny_model("llama", VOCAB)
    engine = BuiltinEngine(model, max_running_requests=4, cuda_graphs=True)
    handle = model.model.layers[0].register_forward_hook(lambda m, i, o: None)
    generate(engine, requests(2, seed=1, max_new=5))
    assert engine.health()["static_decode_steps"] == 0
    handle.remove()
    generate(engine, requests(2, seed=1, max_new=5))
    assert engine.health()["static_decode_steps"] > 0


def flipped_routers(fast: FastDecoder) -> None:
    """Routers that rank the experts the other way round (as a near-tie broken otherwise in bf16
    would, on every token): the fast path then computes other experts, correctly."""
    for layer in fast.layers:
        router = copy.deepcopy(layer.router)
        router.weight.data = router.weight.data.flip(0)
        layer.router = router


def test_start_check_compares_over_the_routing_the_fast_path_chose():
    model = tiny_model("qwen3_moe", VOCAB)
    fast = FastDecoder(model, 4, 64)
    assert agrees_with_model(model, fast) is None
    flipped_routers(fast)
    assert "differ" in agrees_with_model(model, fast, force_routing=False)  # other experts than the model's
    assert agrees_with_model(model, fast, force_routing=True) is None  # the same experts: they agree
    for layer in fast.layers:  # a wrong expert computation is refused all the same
        layer.down = layer.down * 1.5
    assert "differ" in agrees_with_model(model, fast, force_routing=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_bf16_moe_takes_the_fast_path_and_a_wrong_one_is_refused(family, monkeypatch, caplog):
    model = tiny_model(family, VOCAB).to(torch.bfloat16)
    assert type(fast_decoder_for(model, 4, 64)) is FastDecoder
    original = FastDecoder._mlp

    def wrong_mlp(self, L, x):
        return original(self, L, x) * -3.0

    monkeypatch.setattr(FastDecoder, "_mlp", wrong_mlp)
    assert type(fast_decoder_for(model, 4, 64)) is GenericDecoder  # the model's own MoE modules
    monkeypatch.setattr(generic_decoder, "probe_kv_shapes", lambda model: "not this one")
    with caplog.at_level("WARNING"):
        assert fast_decoder_for(model, 4, 64) is None
    refusal = [r for r in caplog.records if "Hugging Face forward path" in r.getMessage()]
    assert refusal and refusal[0].levelname == "WARNING"
    assert "hand-written path: logits differ" in refusal[0].getMessage()


def test_the_grouped_matmul_probe_agrees_on_cpu():
    """The probe that decides the grouped matmul for CUDA dtypes other than bf16, run where it can be."""
    assert grouped_mm_agrees(torch.device("cpu"), torch.float32)
    assert grouped_mm_agrees(torch.device("cpu"), torch.bfloat16)


def test_gpu_engine_benchmark_runs_on_cpu_and_ends_with_its_json(tmp_path):
    """benchmarks/gpu_engine.py --quick: the script the GPU runs, checked here so it cannot rot."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_engine.py"
    args = ["--quick", "--device", "cpu", "--shapes", "dense,mixtral", "--batches", "1,2", "--new-tokens", "4"]
    args += ["--repeats", "1", "--gen-repeats", "1", "--no-checks", "--out", str(tmp_path / "out.json")]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    dense = result["shapes"]["dense"]
    assert dense["forward"] == "fast" and set(dense["decode_ms"]["graphs"]) == {"1", "2"}
    assert dense["correctness"]["greedy_prefix_agreement"] == 1.0
    assert result["shapes"]["mixtral"]["forward"] == "fast"
    assert json.loads((tmp_path / "out.json").read_text())["shapes"].keys() == result["shapes"].keys()


def test_expert_load_counts_across_inference_and_grad_free_forwards():
    """The engine's steps run under inference_mode, the weight probe under no_grad: one recorder sees both."""
    model = tiny_model("qwen3_moe", VOCAB)
    recorder = ExpertLoadRecorder.attach(model)
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        model(input_ids=ids)
    with torch.no_grad():
        model(input_ids=ids)
    model(input_ids=ids)
    counts = recorder.take()
    recorder.detach()
    top_k = model.config.num_experts_per_tok
    assert (counts.sum(axis=1) == 3 * 3 * top_k).all()
