"""LoRA in the learner (issue 35; docs/learner.md "LoRA"): real models, a real Redis buffer, peft's
own adapters. Only the adapters train and move (the base stays bit for bit), the KL reference is the
base under adapters_disabled, a push holds only `{module}.lora_A.weight` / `.lora_B.weight` and an
engine that adds (alpha / rank) * B @ A to its base weights holds the learner's policy, checkpoints
hold the adapters in PEFT's format and resume bitwise, and bad input fails before anything trains."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from test_cli_errors import EXAMPLE, assert_one_clean_error
from test_learner import _fill

from slime.algorithms.batch import collate
from slime.buffer import TrajectoryStore
from slime.config import ConfigError, LoraSettings, load_config
from slime.learner import Learner, LearnerGroup, lora, response_logprobs
from slime.learner.lora import LoraError
from slime.learner.sharding import CheckpointError, full_tensor
from slime.model import load_model
from slime.sample import Sample

PROMPT, PROBE = [6, 7, 77, 61, 86], [6, 7, 6, 7, 40]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _cfg(job, tmp_path, *overrides, lora_on=True):
    return load_config(
        None,
        [
            f"job_name={job}",
            f"output_dir={tmp_path}",
            "rollout.batch_size=1",
            "algorithm.kl_coef=0.01",
            "weights.transport=file",  # whole tensors in one file: the push, read back here
            *(["learner.lora.rank=8"] if lora_on else []),
            *overrides,
        ],
    )


def _filled(redis_url, job, groups=2, skip=0) -> None:
    buffer = TrajectoryStore.open(redis_url, job)
    buffer.delete_job()
    _fill(buffer, groups=groups, n=4)
    if skip:  # the groups another learner already trained
        assert len(buffer.claim_groups(skip, 99)) == skip
        buffer.commit_step(99)


def _learner(model_dir, redis_url, job, tmp_path, *overrides, skip=0, lora_on=True) -> Learner:
    _filled(redis_url, job, skip=skip)
    return Learner(_cfg(job, tmp_path, *overrides, lora_on=lora_on), str(model_dir), redis_url)


def _optim_state(learner: Learner) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state by parameter name, whole tensors (gathered when sharded)."""
    names = {id(p): n for n, p in learner.policy.named_parameters()}
    return {names[id(p)]: {k: full_tensor(v).clone() for k, v in st.items()} for p, st in learner.optim.state.items()}


def _assert_same_optim_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) == 32  # the adapters' AdamW state only
    for name, state in a.items():
        assert state.keys() == b[name].keys() and all(torch.equal(state[k], b[name][k]) for k in state), name


def _probe_batch():
    s = Sample(group_id="probe", index=0, prompt_ids=PROMPT, max_new_tokens=len(PROBE))
    s.append(PROBE, np.zeros(len(PROBE)), 0)
    return collate([s], [0], 0)


# ---- config and bad input -----------------------------------------------------------------------
def test_config_fields_and_what_they_refuse():
    cfg = load_config(None, ["learner.lora.rank=4"])
    assert cfg.learner.lora == LoraSettings(rank=4)
    assert (
        cfg.learner.lora.target_modules == ATTENTION
        and cfg.learner.lora.alpha == 16
        and cfg.learner.lora.layers is None
    )
    assert load_config(None, []).learner.lora is None
    for bad, why in [
        ("learner.lora.rank=0", "rank"),
        ("learner.lora.dropout=1", "dropout"),
        ("learner.lora.alpha=0", "alpha"),
        ("learner.lora.target_modules=[]", "at least one module"),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="with a regex"):
        load_config(None, ["learner.lora.target_modules=.*q_proj", "learner.lora.layers=[0]"])
    with pytest.raises(ConfigError, match=r"rollout.engine=sglang.*builtin or vllm"):
        load_config(None, ["learner.lora.rank=8", "rollout.engine=sglang"])


def test_bad_targets_are_refused_before_injecting_naming_the_cause(tiny_model_dir):
    model = load_model(tiny_model_dir)

    def refused(**settings) -> str:
        with pytest.raises(LoraError) as raised:
            lora.apply_lora(model, LoraSettings(**settings))
        assert not any(lora._is_lora_layer(m) for m in model.modules())  # nothing was injected
        return str(raised.value)

    msg = refused(target_modules=["q_proj", "qkv_proj"])
    assert "'qkv_proj' matches no module" in msg and "end with: q_proj, k_proj, v_proj, o_proj, lm_head" in msg
    msg = refused(target_modules=["gate"])  # the MoE router
    assert "model.layers.0.mlp.gate (Qwen3MoeTopKRouter), which is not an nn.Linear" in msg
    msg = refused(target_modules=["experts"])
    assert "LoRA on MoE experts is not supported" in msg and "gate_up_proj [8, 256, 128]" in msg
    msg = refused(target_modules=["gate_up_proj"])  # a fused 3-D parameter, not a module
    assert "matches no module" in msg and "LoRA on MoE experts is not supported" in msg
    msg = refused(rank=65)
    assert "learner.lora.rank=65" in msg and "model.layers.0.self_attn.k_proj: nn.Linear 128 -> 64" in msg
    assert "weight [64, 128]" in msg
    assert "layer(s) [7]" in refused(layers=[0, 7])
    assert "in layers [9]" in refused(target_modules=["q_proj"], layers=[9])
    names = lora.apply_lora(model, LoraSettings(rank=64, target_modules=r".*\.[13]\.self_attn\.(q|v)_proj"))
    assert names == [f"model.layers.{i}.self_attn.{m}_proj" for i in (1, 3) for m in "qv"]


def test_a_job_with_a_bad_target_fails_at_start_in_one_line(tmp_path, slime_main):
    """Checked on the model's architecture (meta device) before Ray or any actor starts."""
    done = slime_main(
        "train", EXAMPLE, "learner.lora.target_modules=[q_proj, qkv]", f"output_dir={tmp_path}", "steps=1"
    )
    assert_one_clean_error(done, "learner.lora.target_modules: 'qkv' matches no module of Qwen3MoeForCausalLM")


# ---- what trains, what moves ----------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_step_changes_only_the_adapters(tiny_model_dir, redis_url, tmp_path, algo):
    learner = _learner(tiny_model_dir, redis_url, f"lora-step-{algo}", tmp_path, f"algorithm.name={algo}")
    assert learner.ref is learner.policy and learner.packed  # no second copy; packing still checked and on
    trainable = [n for n, p in learner.policy.named_parameters() if p.requires_grad]
    assert trainable and all(lora.public_name(n) is not None for n in trainable)
    before = {n: p.detach().clone() for n, p in learner.policy.named_parameters()}
    for step in range(2):  # the first step moves only B (A's gradient is B = 0); the second both
        m = learner.train_step(step, num_groups=1)
        assert np.isfinite(m["loss"]) and m["samples"] == 4
    assert m["kl"] > 0  # the adapters moved the policy away from its reference, the base
    for name, param in learner.policy.named_parameters():
        assert torch.equal(param, before[name]) != (name in trainable), name  # base bit-identical
    if algo == "ppo":  # the critic stays a full value model (docs/learner.md, "LoRA")
        assert all(p.requires_grad for p in learner.critic.parameters()) and np.isfinite(m["vf_loss"])
    learner.close()


@pytest.mark.parametrize(
    "algo, extra",
    [
        ("gspo", []),
        ("cispo", []),
        ("rloo", ["algorithm.correction.name=tis"]),
        ("reinforce_pp", ["algorithm.correction.name=m2po"]),  # a batch-level correction: pi_old recomputed
        ("dr_grpo", ["learner.num_minibatches=2", "learner.micro_batch_size=2"]),
    ],
)
def test_every_algorithm_trains_adapters(tiny_model_dir, redis_url, tmp_path, algo, extra):
    learner = _learner(tiny_model_dir, redis_url, f"lora-{algo}", tmp_path, f"algorithm.name={algo}", *extra)
    m = learner.train_step(0, num_groups=1)
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    learner.close()


def test_the_reference_is_the_base_model_exactly(tiny_model_dir, redis_url, tmp_path):
    learner = _learner(tiny_model_dir, redis_url, "lora-ref", tmp_path)
    learner.train_step(0, num_groups=1)
    learner.train_step(1, num_groups=1)
    batch = _probe_batch()
    with torch.no_grad(), lora.as_reference(learner.ref):
        assert not learner.ref.training
        ref = response_logprobs(learner.ref, batch, 1.0, packed=learner.packed)[0]
    assert learner.policy.training and all(p.requires_grad for p in learner.trainable)
    # The base as a full fine-tuning learner holds it (packed, its output head set up the same way).
    full = _learner(tiny_model_dir, redis_url, "lora-ref-base", tmp_path, lora_on=False)
    with torch.no_grad():
        base = response_logprobs(full.policy.eval(), batch, 1.0, packed=full.packed)[0]
    assert torch.equal(ref, base)
    policy = torch.tensor(learner.probe_logprobs(PROMPT, PROBE))  # the adapters back on
    assert (policy - ref[0]).abs().max() > 1e-6
    full.close()
    learner.close()


def test_state_push_and_memory_are_a_few_percent_of_full_fine_tuning(tiny_model_dir, redis_url, tmp_path):
    figures = {}
    for kind in ("full", "lora"):
        learner = _learner(tiny_model_dir, redis_url, f"lora-size-{kind}", tmp_path, lora_on=kind == "lora")
        learner.train_step(0, num_groups=1)
        handle = learner.publish_weights()
        figures[kind] = {
            "trainable": sum(p.numel() for p in learner.trainable),
            **learner.memory(),
            "push_bytes": handle.total_bytes,
            "names": [m.name for m in handle.metas],
        }
        learner.close()
    full, low = figures["full"], figures["lora"]
    print({k: (low[k], full[k]) for k in ("trainable", "optimizer_bytes", "grad_bytes", "push_bytes")})
    assert low["trainable"] == 4 * (8 * (128 + 128) * 2 + 8 * (128 + 64) * 2)  # 4 layers x q, o, k, v
    for key in ("trainable", "optimizer_bytes", "grad_bytes", "push_bytes"):
        assert 0 < low[key] <= 0.05 * full[key], key
    expected = [f"model.layers.{i}.self_attn.{m}.lora_{ab}.weight" for i in range(4) for m in ATTENTION for ab in "AB"]
    assert low["names"] == expected


def test_the_push_is_peft_s_format_and_an_engine_merging_it_holds_the_policy(tiny_model_dir, redis_url, tmp_path):
    """The contract: W = W_base + (alpha / rank) * B @ A for every pushed module, from the first push."""
    learner = _learner(tiny_model_dir, redis_url, "lora-push", tmp_path, "learner.lora.alpha=32", "learner.lora.rank=4")
    first = load_file(learner.publish_weights().buckets[0])
    assert all(torch.equal(t, torch.zeros_like(t)) for n, t in first.items() if n.endswith("lora_B.weight"))
    learner.train_step(0, num_groups=1)
    learner.train_step(1, num_groups=1)
    pushed = load_file(learner.publish_weights().buckets[0])
    peft_keys = get_peft_model_state_dict(learner.policy)
    assert pushed.keys() == peft_keys.keys() and all(torch.equal(pushed[k], peft_keys[k]) for k in pushed)
    a = pushed["model.layers.0.self_attn.k_proj.lora_A.weight"]
    b = pushed["model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert a.shape == (4, 128) and b.shape == (64, 4) and b.abs().max() > 0
    engine = load_model(tiny_model_dir).eval()
    weights = dict(engine.named_parameters())
    with torch.no_grad():
        for name in pushed:
            if name.endswith(".lora_A.weight"):
                module = name.removesuffix(".lora_A.weight")
                delta = (32 / 4) * pushed[f"{module}.lora_B.weight"] @ pushed[name]
                weights[f"{module}.weight"].add_(delta)
        got = response_logprobs(engine, _probe_batch(), 1.0)[0][0]
    np.testing.assert_allclose(got.numpy(), learner.probe_logprobs(PROMPT, PROBE), atol=1e-5)
    learner.close()


def test_routing_replay_mixed_precision_and_activation_checkpointing(tiny_model_dir, redis_url, tmp_path):
    """Attention LoRA on the tiny MoE: replayed experts, bf16 mixed precision (an FSDP2 group of one:
    frozen and trainable parameters in one unit), and recomputed activations (same gradients)."""
    from test_routing_replay import PROMPTS, _generate, _sample

    out = _generate(load_model(tiny_model_dir))
    samples = [_sample(p, out[f"r{i}"]) for i, p in enumerate(PROMPTS)]
    samples[1].reward = 0.0
    learner = _learner(tiny_model_dir, redis_url, "lora-replay", tmp_path, "learner.routing_replay=true")
    m = learner.update(samples, [0, 0], step=0)
    assert np.isfinite(m["loss"]) and m["mismatch_fresh_logp_abs_diff"] < 2e-4  # B = 0: the engine's policy
    learner.close()
    grads = {}
    for name, extra in [("plain", []), ("recompute", ["learner.activation_checkpointing=true"])]:
        learner = _learner(tiny_model_dir, redis_url, f"lora-ac-{name}", tmp_path, *extra)
        learner.train_step(0, num_groups=1)
        learner.train_step(1, num_groups=1)
        grads[name] = {n: p.grad.clone() for n, p in learner.policy.named_parameters() if p.grad is not None}
        learner.close()
    assert len(grads["plain"]) == 32 and grads["plain"].keys() == grads["recompute"].keys()
    assert all(torch.equal(grads["plain"][n], grads["recompute"][n]) for n in grads["plain"])
    learner = _learner(tiny_model_dir, redis_url, "lora-bf16", tmp_path, "learner.mixed_precision=true")
    base = {n: p.detach().clone() for n, p in learner.policy.named_parameters() if not p.requires_grad}
    for step in range(2):
        assert np.isfinite(learner.train_step(step, num_groups=1)["loss"])
    assert all(torch.equal(p, base[n]) for n, p in learner.policy.named_parameters() if n in base)
    pushed = load_file(learner.publish_weights().buckets[0])
    assert len(pushed) == 32 and all(t.dtype == torch.float32 for t in pushed.values())
    learner.close()


# ---- checkpoints ---------------------------------------------------------------------------------
def test_checkpoint_resumes_bitwise_and_peft_loads_its_adapter(tiny_model_dir, redis_url, tmp_path):
    a = _learner(tiny_model_dir, redis_url, "lora-ckpt-a", tmp_path, "algorithm.name=ppo")
    a.train_step(0, num_groups=1)
    a.save(str(tmp_path / "ckpt"))
    a.train_step(1, num_groups=1)
    expected, expected_optim = lora.adapter_state(a.policy), _optim_state(a)
    a.close()
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["adapter", "base_model.json", "learner.json", "learner_state.pt"]
    assert sorted(p.name for p in (ckpt / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = json.loads((ckpt / "base_model.json").read_text())
    assert base["model_dir"] == str(tiny_model_dir.resolve()) and base["sha256"] == lora.base_model_hash(tiny_model_dir)

    b = _learner(tiny_model_dir, redis_url, "lora-ckpt-b", tmp_path, "algorithm.name=ppo", skip=1)
    assert b.load(str(ckpt)) == 1
    # PEFT loads the adapter/ directory onto the plain base: the learner's logprobs.
    peft_model = PeftModel.from_pretrained(load_model(tiny_model_dir), str(ckpt / "adapter")).eval()
    with torch.no_grad():
        got = response_logprobs(peft_model, _probe_batch(), 1.0)[0][0]
    np.testing.assert_allclose(got.numpy(), b.probe_logprobs(PROMPT, PROBE), atol=1e-5)
    merged = lora.merged_policy(ckpt, tiny_model_dir).eval()
    with torch.no_grad():
        got = response_logprobs(merged, _probe_batch(), 1.0)[0][0]
    np.testing.assert_allclose(got.numpy(), b.probe_logprobs(PROMPT, PROBE), atol=1e-5)
    b.train_step(1, num_groups=1)
    resumed, resumed_optim = lora.adapter_state(b.policy), _optim_state(b)
    assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in expected)
    _assert_same_optim_state(expected_optim, resumed_optim)
    b.close()


def test_checkpoints_move_between_sharded_and_plain_learners(tiny_model_dir, redis_url, tmp_path):
    """A 1-rank LoRA checkpoint into a sharded learner (FSDP2, a group of one: mixed precision) and its
    sharded checkpoint (dcp/: adapters and their AdamW state, no base) back into a plain one."""
    plain = _learner(tiny_model_dir, redis_url, "lora-move-plain", tmp_path)
    plain.train_step(0, num_groups=1)
    plain.train_step(1, num_groups=1)
    plain.save(str(tmp_path / "plain"))
    adapters, optim = lora.adapter_state(plain.policy), _optim_state(plain)
    plain.close()
    sharded = _learner(tiny_model_dir, redis_url, "lora-move-sharded", tmp_path, "learner.mixed_precision=true")
    assert sharded.load(str(tmp_path / "plain")) == 2
    moved = lora.adapter_state(sharded.policy)
    assert all(torch.equal(moved[k], adapters[k]) for k in adapters)
    _assert_same_optim_state(optim, _optim_state(sharded))
    sharded.save(str(tmp_path / "sharded"))
    sharded.close()
    dcp_bytes = sum(f.stat().st_size for f in (tmp_path / "sharded" / "dcp").iterdir())
    assert dcp_bytes < 0.1 * (tiny_model_dir / "model.safetensors").stat().st_size  # the frozen base is not in it
    back = _learner(tiny_model_dir, redis_url, "lora-move-back", tmp_path)
    assert back.load(str(tmp_path / "sharded")) == 2
    moved = lora.adapter_state(back.policy)
    assert all(torch.equal(moved[k], adapters[k]) for k in adapters)
    _assert_same_optim_state(optim, _optim_state(back))
    back.close()


def test_a_checkpoint_of_another_base_or_kind_is_refused(tiny_model_dir, redis_url, tmp_path):
    learner = _learner(tiny_model_dir, redis_url, "lora-refuse", tmp_path)
    learner.save(str(tmp_path / "lora-ckpt"))
    learner.close()
    # The same architecture, one base weight changed: another base.
    other = tmp_path / "other-base"
    shutil.copytree(tiny_model_dir, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1e-3
    save_file(weights, str(other / "model.safetensors"), {"format": "pt"})
    moved = _learner(other, redis_url, "lora-refuse", tmp_path)
    with pytest.raises(CheckpointError) as raised:
        moved.load(str(tmp_path / "lora-ckpt"))
    msg = str(raised.value)
    for part in (lora.base_model_hash(tiny_model_dir), lora.base_model_hash(other), str(tiny_model_dir), str(other)):
        assert part in msg
    moved.close()
    full = _learner(tiny_model_dir, redis_url, "lora-refuse", tmp_path, lora_on=False)
    with pytest.raises(CheckpointError, match="holds LoRA adapters .*but learner.lora is not set"):
        full.load(str(tmp_path / "lora-ckpt"))
    full.save(str(tmp_path / "full-ckpt"))
    full.close()
    low = _learner(tiny_model_dir, redis_url, "lora-refuse", tmp_path, "learner.lora.rank=4")
    with pytest.raises(CheckpointError, match="holds a fully fine-tuned policy"):
        low.load(str(tmp_path / "full-ckpt"))
    with pytest.raises(CheckpointError, match="rank: checkpoint 8, config 4"):
        low.load(str(tmp_path / "lora-ckpt"))
    low.close()


def test_the_base_hash_is_sha256_of_the_weight_files_cached_by_size_and_mtime(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "b.safetensors").write_bytes(b"second")
    (base / "a.bin").write_bytes(b"first")
    (base / "config.json").write_text("{}")  # not a weight file
    cache = tmp_path / "cache.json"
    digest = lora.base_model_hash(base, cache)
    assert digest == hashlib.sha256(b"firstsecond").hexdigest()
    entry = json.loads(cache.read_text())[str(base.resolve())]
    entry["sha256"] = "cached"  # files unchanged: the cache answers, nothing is read
    cache.write_text(json.dumps({str(base.resolve()): entry}))
    assert lora.base_model_hash(base, cache) == "cached"
    (base / "a.bin").write_bytes(b"FIRST")  # size and mtime change: hashed again
    assert lora.base_model_hash(base, cache) == hashlib.sha256(b"FIRSTsecond").hexdigest()


# ---- a 50M-parameter model: the figures at a real vocabulary -----------------------------------------
@pytest.fixture(scope="module")
def model_58m(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("qwen3-58m")
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def test_a_58m_model_trains_0_4_percent_of_its_parameters(model_58m, redis_url, tmp_path):
    learner = _learner(model_58m, redis_url, "lora-58m", tmp_path, "algorithm.kl_coef=0")
    total = sum(p.numel() for p in learner.policy.parameters())
    trainable = sum(p.numel() for p in learner.trainable)
    learner.train_step(0, num_groups=1)
    optimizer_bytes = learner.memory()["optimizer_bytes"]
    push_bytes = learner.publish_weights().total_bytes
    learner.close()
    full = total - trainable  # the base model's parameters: what full fine-tuning trains and pushes
    print(
        f"58M: trainable {trainable} of {full}, AdamW {optimizer_bytes} vs {8 * full}, push {push_bytes} vs {4 * full}"
    )
    assert full > 50e6 and trainable == 8 * (8 * (512 + 512) * 2 + 8 * (512 + 256) * 2)
    assert optimizer_bytes == 8 * trainable and push_bytes == 4 * trainable
    assert trainable / full < 0.005


# ---- two ranks ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_resume_bitwise(tiny_model_dir, redis_url, tmp_path, ray_session):
    """2 FSDP2 ranks, PPO (the frozen base sharded with the adapters, the reference under
    adapters_disabled, the full critic): step, save, step; a fresh group loads and takes the same
    step: adapters, their AdamW state and the critic bitwise."""
    from slime.launch.ray_cluster import RayLauncher

    def group_of(job, skip=0):
        _filled(redis_url, job, skip=skip)
        two = ["learner.num_ranks=2", "learner.micro_batch_size=3", "algorithm.name=ppo"]
        return LearnerGroup(_cfg(job, tmp_path, *two), str(tiny_model_dir), redis_url, None, RayLauncher())

    first = group_of("lora-two-a")
    try:
        first.result(first.train_step(0, 1, None, commit=True))
        first.result(first.save(str(tmp_path / "at-1")))
        m = first.result(first.train_step(1, 1, None, commit=True))
        assert np.isfinite(m["loss"]) and m["kl"] > 0
        first.result(first.save(str(tmp_path / "at-2")))
        pushed = load_file(first.result(first.publish_weights()).buckets[0])
    finally:
        first.result(first.close())
        first.kill()
    assert len(pushed) == 32 and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in pushed)
    assert not any(".default." in n for n in pushed)  # peft's adapter name never travels
    second = group_of("lora-two-b", skip=1)
    try:
        assert second.result(second.load(str(tmp_path / "at-1"))) == 1
        second.result(second.train_step(1, 1, None, commit=True))
        second.result(second.save(str(tmp_path / "again-2")))
    finally:
        second.result(second.close())
        second.kill()
    assert sorted(p.name for p in (tmp_path / "at-2").iterdir()) == [
        "adapter",
        "base_model.json",
        "dcp",
        "learner.json",
    ]
    a, b = lora.read_adapter(tmp_path / "at-2"), lora.read_adapter(tmp_path / "again-2")
    assert a.keys() == b.keys() == pushed.keys() and all(
        torch.equal(a[k], b[k]) and torch.equal(a[k], pushed[k]) for k in a
    )
    states = []
    for ckpt in ("at-2", "again-2"):  # the sharded AdamW state, read back by one rank
        one = _learner(tiny_model_dir, redis_url, f"lora-two-read-{ckpt}", tmp_path, "algorithm.name=ppo")
        one.load(str(tmp_path / ckpt))
        critic = {k: v.clone() for k, v in one.critic.state_dict().items()}
        states.append((lora.adapter_state(one.policy), _optim_state(one), critic))
        one.close()
    (wa, oa, ca), (wb, ob, cb) = states
    assert all(torch.equal(wa[k], a[k]) and torch.equal(wb[k], a[k]) for k in a)
    _assert_same_optim_state(oa, ob)
    assert ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in ca)  # the full critic too


@pytest.fixture(scope="module")
def dense_model_dir(tmp_path_factory):
    """A tiny dense Llama (not converted by transformers, so PEFT adds no key prefix of its own) with
    the config's attention dropout at 0.1, as GPT-2, OPT and Phi-2 ship theirs."""
    from benchmarks.families import tiny_model
    from slime.model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer), attention_dropout=0.1, pad_token_id=tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("dense") / "llama"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_dense_models_adapters_load_in_peft_as_trained(dense_model_dir, redis_url, tmp_path):
    """PEFT's files key the adapters `base_model.model.{module}...`; written without that prefix, PEFT
    loaded a dense model's adapter directory as the bare base (only a warning). Read back, the
    checkpoint's adapters are the trained ones again."""
    learner = _learner(dense_model_dir, redis_url, "lora-dense", tmp_path, "learner.lr=0.05")
    learner.train_step(0, num_groups=1)
    learner.save(str(tmp_path / "ckpt"))
    keys = load_file(str(tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors")).keys()
    assert keys and all(k.startswith("base_model.model.") for k in keys)
    assert lora.read_adapter(tmp_path / "ckpt").keys() == lora.adapter_state(learner.policy).keys()
    want = learner.probe_logprobs(PROMPT, PROBE)
    base = load_model(dense_model_dir).eval()
    with torch.no_grad():
        bare = response_logprobs(base, _probe_batch(), 1.0)[0][0].numpy()
        peft_model = PeftModel.from_pretrained(base, str(tmp_path / "ckpt" / "adapter")).eval()
        got = response_logprobs(peft_model, _probe_batch(), 1.0)[0][0].numpy()
    assert np.abs(want - bare).max() > 1e-4  # the adapters moved the policy
    np.testing.assert_allclose(got, want, atol=1e-5)
    learner.close()


def test_the_learner_computes_without_the_models_dropout(dense_model_dir, redis_url, tmp_path):
    """π_old, π and the engine's behaviour logprobs are one function of the weights: the model's own
    dropout (0.1 in this config) is off in the learner, LoRA's own dropout stays as configured."""
    from slime.model import disable_dropout

    learner = _learner(
        dense_model_dir, redis_url, "lora-dropout", tmp_path, "learner.lora.dropout=0.5", "learner.lr=0.05"
    )
    learner.train_step(0, num_groups=1)  # B moves off zero, so LoRA's dropout shows
    assert learner.policy.training
    batch = _probe_batch()
    first, second = (response_logprobs(learner.policy, batch, 1.0, packed=learner.packed)[0] for _ in range(2))
    assert not torch.equal(first, second)  # LoRA's dropout (0.5) is live in train mode...
    learner.close()
    plain = _learner(dense_model_dir, redis_url, "plain-dropout", tmp_path, lora_on=False)
    first, second = (response_logprobs(plain.policy, batch, 1.0, packed=plain.packed)[0] for _ in range(2))
    torch.testing.assert_close(first, second, rtol=0, atol=0)  # ...the model's own is not
    plain.close()
    model = load_model(dense_model_dir)
    assert disable_dropout(model) == [f"model.layers.{i}.self_attn.attention_dropout" for i in range(2)]
    assert disable_dropout(model) == []
