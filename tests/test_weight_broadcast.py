"""Broadcast weight transport between real processes (gloo): the receivers' logits match the sender's model."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from slime.engines.builtin import BuiltinEngine
from slime.model import load_model
from slime.weights import BroadcastTransport, WeightHandle, make_transport

PROBE = [[3, 9, 4, 17, 22, 5, 8, 30]]


def _receiver(model_dir: str, handles: mp.Queue, results: mp.Queue) -> None:
    """A separate process with its own engine: apply each broadcast version, report logits."""
    torch.set_num_threads(1)
    try:
        engine = BuiltinEngine(load_model(model_dir), max_running_requests=2)
        transport = BroadcastTransport()
        while (handle := handles.get()) is not None:
            engine.update_weights(handle.version, transport.receive(handle))
            with torch.no_grad():
                logits = engine.model(input_ids=torch.tensor(PROBE)).logits
            results.put((engine.version, logits.numpy()))
        transport.close()
    except BaseException as e:  # reported to the test instead of hanging it
        results.put(("error", repr(e)))


def _perturbed(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.timeout(180)
def test_broadcast_moves_a_model_to_two_processes(tiny_model_dir):
    ctx = mp.get_context("spawn")
    n = 2
    handle_queues = [ctx.Queue() for _ in range(n)]
    results = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(str(tiny_model_dir), q, results), daemon=True) for q in handle_queues]
    for p in procs:
        p.start()
    model = load_model(tiny_model_dir)
    sender = make_transport("broadcast", prefix="t", directory=None, bucket_mb=0.05, num_receivers=n)
    try:
        for version in (1, 2):  # the second version reuses the buckets and the group
            _perturbed(model, seed=version)
            handle = sender.publish(version, model.named_parameters())
            assert isinstance(handle, WeightHandle) and len(handle.buckets[0]["sizes"]) > 3  # really bucketed
            for q in handle_queues:
                q.put(handle)
            with torch.no_grad():
                expected = model(input_ids=torch.tensor(PROBE)).logits.numpy()
            for _ in range(n):
                got_version, logits = results.get(timeout=120)
                assert got_version != "error", logits
                assert got_version == version
                assert abs(logits - expected).max() < 1e-5
        # and the receivers really changed: the original weights give other logits
        base = load_model(tiny_model_dir)
        with torch.no_grad():
            assert (base(input_ids=torch.tensor(PROBE)).logits.numpy() - expected).__abs__().max() > 1e-2
    finally:
        for q in handle_queues:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        sender.close()


def test_too_many_receivers_is_a_clear_error():
    sender = BroadcastTransport(num_receivers=1, master_addr="127.0.0.1")
    handle = sender.publish(0, [("w", torch.ones(4))])
    try:
        import torch.distributed as dist

        second = BroadcastTransport()
        # Take rank 1 without joining, as a first engine would; a second engine must be refused.
        dist.TCPStore("127.0.0.1", handle.buckets[0]["master_port"], is_master=False).add("rank", 1)
        with pytest.raises(RuntimeError, match="expects only 1 receivers"):
            list(second.receive(handle))
    finally:
        sender.close()
