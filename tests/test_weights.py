"""Weight transport: bucketing, shared memory across real processes, files, and engine == learner after an update."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from slime.engines.builtin import BuiltinEngine
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.model import load_model
from slime.weights import FileTransport, SharedMemoryTransport, WeightHandle, plan_buckets


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("a", torch.randn(100, generator=g)),
        ("b", torch.randn(3, 7, generator=g).to(torch.bfloat16)),
        ("c", torch.randint(0, 100, (5,), generator=g)),
        ("d", torch.randn(300, generator=g)),
    ]


def test_plan_buckets_splits_and_aligns():
    metas, sizes = plan_buckets(_named(0), bucket_bytes=600)
    assert [m.bucket for m in metas] == [
        0,
        0,
        0,
        1,
    ]  # a, b, c fit in 600 B at 64-B offsets 0, 448, 512; d (1200 B) alone
    assert all(m.offset % 64 == 0 for m in metas)
    assert sizes[1] >= 1200
    assert sum(m.nbytes for m in metas) == 400 + 42 + 40 + 1200


def _receive_in_child(handle: WeightHandle, queue: mp.Queue) -> None:
    transport = SharedMemoryTransport("unused")
    # Raw bytes, not tensors: torch would share tensors through file descriptors of this process.
    queue.put(
        {
            name: (str(t.dtype), t.contiguous().view(torch.uint8).numpy().tobytes())
            for name, t in transport.receive(handle)
        }
    )
    transport.close()


def test_shared_memory_roundtrip_across_processes():
    transport = SharedMemoryTransport(f"slime_test_{mp.current_process().pid}", bucket_mb=0.001)
    try:
        for version, seed in ((1, 0), (2, 1)):  # the second publish reuses the segments
            named = _named(seed)
            handle = transport.publish(version, named)
            assert handle.version == version and len(handle.buckets) >= 2
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            child = ctx.Process(target=_receive_in_child, args=(handle, queue))
            child.start()
            received = queue.get(timeout=60)
            child.join(timeout=60)
            assert child.exitcode == 0
            for name, tensor in named:
                dtype, raw = received[name]
                assert dtype == str(tensor.dtype)
                assert raw == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name
    finally:
        transport.close()


def test_file_transport_roundtrip(tmp_path):
    transport = FileTransport(tmp_path, keep=1)
    named = _named(3)
    transport.publish(1, named)
    handle = transport.publish(2, named)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1  # older versions are pruned
    got = dict(transport.receive(handle))
    for name, tensor in named:
        assert torch.equal(got[name], tensor)


@pytest.mark.parametrize("transport_kind", ["shm", "file"])
def test_engine_matches_learner_after_update(tiny_model_dir, tmp_path, transport_kind):
    torch.manual_seed(0)
    learner_model = load_model(tiny_model_dir)
    engine_model = load_model(tiny_model_dir)
    # The learner moves away from the engine's weights (as after a few RL steps).
    with torch.no_grad():
        for p in learner_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt = [6, 7, 77, 61, 86]  # "ab*3="
    engine = BuiltinEngine(engine_model, max_running_requests=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    before = engine.generate([GenerationRequest("r", prompt, params)])["r"].token_ids

    transport = SharedMemoryTransport("slime_test_engine") if transport_kind == "shm" else FileTransport(tmp_path)
    try:
        handle = transport.publish(7, learner_model.named_parameters())
        engine.update_weights(handle.version, transport.receive(handle))
    finally:
        transport.close()
    assert engine.version == 7

    ids = torch.tensor([prompt + before])
    with torch.no_grad():
        want = learner_model(input_ids=ids).logits
        got = engine_model(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-5)
    after = engine.generate([GenerationRequest("r2", prompt, params)])["r2"].token_ids
    expected = learner_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=len(after),
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        min_new_tokens=len(after),
    )[0, len(prompt) :].tolist()
    assert after == expected


def test_segments_that_any_killed_job_left_in_dev_shm_are_freed_by_the_next_publish() -> None:
    """A job killed with SIGKILL left its weights in /dev/shm until a job of the same name ran again;
    now any job's publish frees this user's segments whose publisher is gone, and only those."""
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    from slime.weights.transports import _PID_NAMESPACE

    orphan = Path(f"/dev/shm/slime_otherjob_{_PID_NAMESPACE}_{dead.pid}_w0")
    live = Path(f"/dev/shm/slime_otherjob_{_PID_NAMESPACE}_{os.getppid()}_w3")
    elsewhere = Path(f"/dev/shm/slime_otherjob_1{_PID_NAMESPACE}_{dead.pid}_w0")  # another pid namespace's
    for path in (orphan, live, elsewhere):
        path.write_bytes(b"\0" * 64)
    transport = SharedMemoryTransport(f"slime_shmtest{os.getpid()}")
    try:
        transport.publish(1, [("w", torch.ones(4))])
        assert not orphan.exists() and live.exists() and elsewhere.exists()
    finally:
        transport.close()
        for path in (orphan, live, elsewhere):
            path.unlink(missing_ok=True)
