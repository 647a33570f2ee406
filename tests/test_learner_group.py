"""The learner group: N real Ray actors in one gloo process group, FSDP2 shards. N ranks take the
optimizer step one rank takes on the same batch; checkpoints move between rank counts; the weight
push gathers the shards; a learner that cannot fit fails at once, naming what is missing."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_export_eval import _prompts, assert_greedy_tokens_match
from test_learner import _fill
from test_security import _WritesMarker
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime.buffer import TrajectoryStore
from slime.config import load_config
from slime.export import export_checkpoint, find_checkpoint
from slime.launch.ray_cluster import RayLauncher
from slime.learner import Learner, LearnerGroup, ResourceError, required_resources
from slime.learner.sharding import CheckpointError, split_rows
from slime.train import train

PROMPT = [6, 7, 77, 61, 86]


def _cfg(job, tmp_path, algo, ranks, *extra):
    return load_config(
        None,
        [
            f"job_name={job}",
            f"output_dir={tmp_path}",
            f"algorithm.name={algo}",
            "rollout.batch_size=3",
            "algorithm.kl_coef=0.01",  # the reference model is sharded too
            "learner.micro_batch_size=3",  # ranks run unequal micro-batch counts: empty passes
            # The router's load-balancing loss is a statistic of each forward's tokens: it changes with
            # which rows share a micro-batch, across ranks as with micro_batch_size. Off here.
            "algorithm.router_aux_coef=0",
            "weights.transport=file",  # whole tensors on disk: the gathered push, compared here
            f"learner.num_ranks={ranks}",
            *extra,
        ],
    )


def _filled(redis_url, job, groups, skip=0):
    buffer = TrajectoryStore.open(redis_url, job)
    buffer.delete_job()
    _fill(buffer, groups=groups, n=4)
    if skip:  # the groups another learner already trained: claimed and set aside
        assert len(buffer.claim_groups(skip, 99)) == skip
        buffer.commit_step(99)
    return buffer


def _relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a) ** 0.5
    return diff / sum(float(a[k].double().norm() ** 2) for k in a) ** 0.5


def _weights(handle) -> dict[str, torch.Tensor]:
    return load_file(handle.buckets[0])


def _greedy(model_dir, weights: dict[str, torch.Tensor]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def test_rows_are_dealt_by_tokens_not_by_count():
    shares = split_rows([100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10], 2)
    assert shares[0] == [0]  # the long row alone balances the ten short ones
    assert sorted(shares[0] + shares[1]) == list(range(11))
    assert split_rows([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert split_rows([3], 2) == [[0], []]  # a rank may get nothing: it then runs empty passes


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_two_ranks_take_the_optimizer_step_one_rank_takes(tiny_model_dir, redis_url, tmp_path, ray_session, algo):
    _filled(redis_url, f"one-{algo}", groups=3)
    _filled(redis_url, f"two-{algo}", groups=3)
    one = Learner(_cfg(f"one-{algo}", tmp_path, algo, 1), str(tiny_model_dir), redis_url)
    before = {n: p.detach().clone() for n, p in one.policy.named_parameters()}
    m1 = one.train_step(0, num_groups=3)
    w1 = _weights(one.publish_weights())
    one.close()
    # PPO's two ranks cut micro-batches by tokens: a cut of its own, and still the one-batch step.
    by_tokens = ["learner.max_tokens_per_micro_batch=30"] if algo == "ppo" else []
    group = LearnerGroup(
        _cfg(f"two-{algo}", tmp_path, algo, 2, *by_tokens), str(tiny_model_dir), redis_url, None, RayLauncher()
    )
    try:
        m2 = group.result(group.train_step(0, 3, None, commit=True))
        w2 = _weights(group.result(group.publish_weights()))
    finally:
        group.result(group.close())
        group.kill()
    assert _relative_difference(before, w1) > 1e-4  # the step moved the weights
    assert _relative_difference(w1, w2) < 1e-5
    assert m1["samples"] == m2["samples"] == 12 and m1["trained_tokens"] == m2["trained_tokens"]
    # The reported figures are the whole batch's, not rank 0's half.
    for key in ["loss", "pg_loss", "grad_norm", "entropy", "mismatch_fresh_tokens"] + (
        ["vf_loss", "critic_grad_norm"] if algo == "ppo" else []
    ):
        assert m2[key] == pytest.approx(m1[key], rel=1e-3, abs=1e-6), key
    assert m2["policy_version"] == 1
    assert TrajectoryStore.open(redis_url, f"two-{algo}").counts()["groups_ready"] == 0  # claimed once


def test_activation_checkpointing_and_mixed_precision_change_no_update(tiny_model_dir, redis_url, tmp_path):
    """Recomputing activations in backward takes the same step; bf16 mixed precision (FSDP2, a group
    of one) takes a step close to it, publishing fp32 master weights."""
    weights = {}
    for name, extra in (
        ("plain", []),
        ("recompute", ["learner.activation_checkpointing=true"]),
        ("bf16", ["learner.mixed_precision=true"]),
    ):
        _filled(redis_url, f"ac-{name}", groups=2)
        learner = Learner(_cfg(f"ac-{name}", tmp_path / name, "ppo", 1, *extra), str(tiny_model_dir), redis_url)
        learner.train_step(0, num_groups=2)
        weights[name] = _weights(learner.publish_weights())
        learner.close()
    assert all(torch.equal(weights["plain"][k], weights["recompute"][k]) for k in weights["plain"])
    assert all(w.dtype == torch.float32 for w in weights["bf16"].values())
    assert _relative_difference(weights["plain"], weights["bf16"]) < 1e-2


def test_checkpoints_move_between_rank_counts(tiny_model_dir, redis_url, tmp_path, ray_session):
    """Saved by 2 ranks, resumed by 1: the same weights and optimizer state, so the next step is the
    one the 2 ranks take, and greedy decoding agrees token for token. And 1 -> 2 ranks."""
    _filled(redis_url, "ckpt-two", groups=6)
    _filled(redis_url, "ckpt-one", groups=6, skip=3)
    group = LearnerGroup(_cfg("ckpt-two", tmp_path, "ppo", 2), str(tiny_model_dir), redis_url, None, RayLauncher())
    one = None
    try:
        group.result(group.train_step(0, 3, None, commit=True))
        group.result(group.save(str(tmp_path / "by-two")))
        at_save = _weights(group.result(group.publish_weights()))
        one = Learner(_cfg("ckpt-one", tmp_path, "ppo", 1), str(tiny_model_dir), redis_url)
        assert one.load(str(tmp_path / "by-two")) == 1
        resumed = _weights(one.publish_weights())
        assert all(torch.equal(at_save[k], resumed[k]) for k in at_save)
        assert _greedy(tiny_model_dir, resumed) == _greedy(tiny_model_dir, at_save)

        group.result(group.train_step(1, 3, None, commit=True))
        one.train_step(1, num_groups=3)
        after_two = _weights(group.result(group.publish_weights()))
        after_one = _weights(one.publish_weights())
        # Adam's second step depends on the moments the checkpoint carried.
        assert _relative_difference(after_two, after_one) < 1e-5
        assert _greedy(tiny_model_dir, after_one) == _greedy(tiny_model_dir, after_two)

        one.save(str(tmp_path / "by-one"))  # the 1-rank format: a Hugging Face policy and torch state
        assert group.result(group.load(str(tmp_path / "by-one"))) == 2
        reloaded = _weights(group.result(group.publish_weights()))
        assert all(torch.equal(after_one[k], reloaded[k]) for k in after_one)

        # The sharded format's index is a pickle: a crafted one is refused before it runs anything.
        marker = tmp_path / "pwned"
        with open(tmp_path / "by-two" / "dcp" / ".metadata", "wb") as f:
            pickle.dump(_WritesMarker(marker), f)
        with pytest.raises(CheckpointError, match="checkpoint index refers to posix.system"):
            one.load(str(tmp_path / "by-two"))
        assert not marker.exists()
    finally:
        if one is not None:
            one.close()
        group.result(group.close())
        group.kill()


@pytest.mark.parametrize(
    "overrides, missing",
    [
        (["learner.device=cuda", "learner.num_ranks=2"], "GPU: needs 2"),
        (["learner.num_ranks=2", "learner.resources_per_rank={learner_node: 1}"], "learner_node: needs 2"),
        (["learner.num_ranks=3", "learner.cpus_per_rank=1", "cluster.num_cpus=2"], "CPU: needs 3"),
        # Engines on GPUs: colocated they share the learner's, disaggregated they need their own.
        (["learner.device=cuda", "rollout.device=cuda", "rollout.num_workers=2"], "GPU: needs 2"),
        (
            ["learner.device=cuda", "rollout.device=cuda", "rollout.num_workers=2", "cluster.placement=disaggregated"],
            "GPU: needs 3",
        ),
    ],
)
def test_a_job_that_does_not_fit_fails_at_once_naming_the_resource(
    tiny_model_dir, redis_url, tmp_path, overrides, missing
):
    """Before Redis, the model or Ray start when the job starts its own Ray (this machine's CPUs and
    GPUs); once connected when a Ray runs already (this session's, when another test started it)."""
    common = [f"model.path={tiny_model_dir}", f"buffer.url={redis_url}", "steps=1"]
    cfg = load_config(None, ["job_name=too-big", f"output_dir={tmp_path}", *common, *overrides])
    assert required_resources(cfg)
    started = time.time()
    with pytest.raises(ResourceError, match=missing):
        train(cfg)
    assert time.time() - started < 10


def test_engine_memory_release_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="needs the sync loop"):
        load_config(None, ["rollout.release_memory=true", "mode=async"])
    with pytest.raises(ValueError, match="sleep mode, which needs CUDA"):
        load_config(None, ["rollout.release_memory=true", "rollout.engine=vllm"])
    # The default: colocated GPU engines in the sync loop release; CPU engines and async ones do not.
    assert load_config(None, ["rollout.device=cuda"]).releases_engine_memory
    assert not load_config(None, ["rollout.device=cuda", "cluster.placement=disaggregated"]).releases_engine_memory
    assert not load_config(None, ["rollout.device=cuda", "mode=async"]).releases_engine_memory
    assert not load_config(None, []).releases_engine_memory


@pytest.mark.slow
def test_a_two_rank_job_trains_pushes_checkpoints_and_resumes(ray_session, tiny_model_dir, redis_url, tmp_path):
    """The example job with 2 learner ranks: APRIL sync steps, the gathered weights reach the
    engine (the probe and checksum checks after every push), a sharded checkpoint, and resume=auto from it."""
    base = [
        "job_name=two-ranks",
        f"output_dir={tmp_path}",
        f"model.path={tiny_model_dir}",
        f"buffer.url={redis_url}",
        "learner.num_ranks=2",
        "rollout.batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=16",
        "weights.check_every=1",
        "weights.checksum_every=1",  # every tensor, each gathered from both ranks
        "checkpoint.every_steps=2",
        "logging.tensorboard=false",
        "logging.plot=false",
        "logging.progress=false",
    ]
    history = train(load_config(None, [*base, "steps=2"]))
    assert [m["step"] for m in history] == [0, 1]
    assert all(np.isfinite(m["loss"]) and m["samples"] == 16 for m in history)
    checkpoint = tmp_path / "checkpoints" / "step_000002"
    assert (checkpoint / "dcp" / ".metadata").is_file()
    resumed = train(load_config(None, [*base, "steps=3", "resume=auto"]))
    assert resumed[-1]["step"] == 2 and resumed[-1]["policy_version"] == 3
    buffer = TrajectoryStore.open(redis_url, "two-ranks")
    assert buffer.counts()["groups_trained"] == 12  # 3 steps x 4 groups, each trained once
    # `slime export` of the sharded checkpoint: plain transformers loads the weights one rank
    # reads from it (Learner.load, N to 1), and generates the engine's greedy tokens.
    checkpoint = find_checkpoint(tmp_path)
    assert checkpoint.name == "step_000003" and (checkpoint / "dcp").is_dir() and not (checkpoint / "policy").exists()
    export = export_checkpoint(checkpoint, tmp_path / "export")
    one = Learner(load_config(None, [*base, "steps=3", "learner.num_ranks=1"]), str(tiny_model_dir), redis_url)
    try:
        assert one.load(str(checkpoint)) == 3
        exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
        for name, tensor in one.policy.state_dict().items():
            assert torch.equal(exported.state_dict()[name], tensor), name
        # (the learner's own module runs packed attention only: the engine gets the same weights fresh)
        assert_greedy_tokens_match(export, exported, _prompts(AutoTokenizer.from_pretrained(export)))
    finally:
        one.close()
    buffer.delete_job()


def _global_ref(module: str, name: str) -> bytes:
    """A protocol-4 pickle of one global, `module` and `name` as given (STACK_GLOBAL)."""
    m, n = module.encode(), name.encode()
    return b"\x80\x04\x8c" + bytes([len(m)]) + m + b"\x8c" + bytes([len(n)]) + n + b"\x93."


@pytest.mark.parametrize(
    "name",
    ["operator.methodcaller", "operator.attrgetter", "os.system", "FileSystemReader.__init__", "FileSystemReader"],
)
def test_a_checkpoint_index_cannot_walk_from_a_dcp_module_to_other_callables(name):
    """Protocol 4 resolves dotted names attribute by attribute: `operator.methodcaller` looked up in
    a DCP module that imports operator is a type, and attrgetter/itemgetter/methodcaller chained
    reach os.system. Only a DCP module's own classes load."""
    import io

    from slime.learner.sharding import _SafeMetadataUnpickler

    with pytest.raises(pickle.UnpicklingError, match="which a checkpoint never holds"):
        _SafeMetadataUnpickler(io.BytesIO(_global_ref("torch.distributed.checkpoint.filesystem", name))).load()
    from torch.distributed.checkpoint.metadata import Metadata

    got = _SafeMetadataUnpickler(io.BytesIO(_global_ref("torch.distributed.checkpoint.metadata", "Metadata"))).load()
    assert got is Metadata
    # A class of another DCP module, whose constructor has side effects: FsspecReader(url) connects.
    with pytest.raises(pickle.UnpicklingError, match="which a checkpoint never holds"):
        ref = _global_ref("torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader")
        _SafeMetadataUnpickler(io.BytesIO(ref)).load()
