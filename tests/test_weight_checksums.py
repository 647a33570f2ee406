"""Per-tensor weight checksums (slime/weights/checksum.py): the check that sees every tensor, where
the probe sees only what its tokens route through. The sums, what they catch (one element, two
experts swapped, a NaN) and what they leave alone (the same bits summed in another order, the
engine's own buffers); the built-in engine's side; and a job whose engine keeps one expert stale
stopping with the tensor's name."""

from __future__ import annotations

import pytest
import torch

from slime import cli
from slime.engines.builtin import BuiltinEngine
from slime.job import WeightSyncError
from slime.model import load_model
from slime.weights.checksum import checksum_mismatch, checksums, checksums_as, differing, tensor_checksum
from tests.helpers import TINY_JOB


def _named(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(8, 16, 32, generator=g), "b.weight": torch.randn(300, generator=g)}


def test_equal_tensors_agree_and_any_change_is_named():
    learner = _named()
    assert differing(checksums(learner.items()), checksums({k: v.clone() for k, v in learner.items()}.items())) == []
    for change in (
        lambda t: t["a.weight"][3, 7, 1].add_(1e-4),  # one element, a learning step's size
        lambda t: t["a.weight"].index_copy_(0, torch.tensor([2, 5]), t["a.weight"][[5, 2]]),  # experts swapped
        lambda t: t["b.weight"][0].fill_(float("nan")),
    ):
        engine = {k: v.clone() for k, v in learner.items()}
        change(engine)
        assert differing(checksums(learner.items()), checksums(engine.items())) == [
            "a.weight" if engine["b.weight"].isfinite().all() else "b.weight"
        ]


def test_the_same_bits_summed_in_another_order_agree():
    """The engine sums on another device, in other chunks: float64 keeps that far under the tolerance."""
    tensor = torch.randn(3_000_000, dtype=torch.float32)
    expected = tensor_checksum(tensor)
    flat = tensor.double()
    w = 1.0 + torch.arange(flat.numel(), dtype=torch.float64) % 1009 / 1009
    reversed_order = (
        "float32",
        float(flat.flip(0).sum()),
        float((flat * w).flip(0).sum()),
        float((flat.abs() * w).sum()),
    )
    assert differing({"t": expected}, {"t": reversed_order}) == []


def test_the_learner_casts_to_the_engines_dtype_and_compares_only_what_the_engine_has():
    learner = _named()
    engine = {k: torch.empty_like(v, dtype=torch.bfloat16).copy_(v) for k, v in learner.items()}
    engine["model.rotary.inv_freq"] = torch.ones(4)  # a buffer of the engine's own
    got = checksums(engine.items())
    expected = checksums_as(learner.items(), {k: v[0] for k, v in got.items()})
    assert set(expected) == set(learner) and expected["a.weight"][0] == "bfloat16"
    assert differing(expected, got) == []
    assert differing(checksums(learner.items()), got) == ["a.weight", "b.weight"]  # float32 against bfloat16
    del got["b.weight"]
    assert "rollout engine 1 holds 1 of the learner's 2 weight tensors with other values" in checksum_mismatch(
        expected, [None, got]
    )
    assert checksum_mismatch(expected, [None, None]) is None  # engines that give none: nothing to compare


def test_the_builtin_engine_reports_every_tensor_update_weights_writes(tiny_model_dir):
    engine = BuiltinEngine(load_model(str(tiny_model_dir)))
    learner = dict(load_model(str(tiny_model_dir)).named_parameters(remove_duplicate=False))
    for p in learner.values():
        p.data.add_(0.01)
    engine.update_weights(1, learner.items())
    got = engine.weight_checksums()
    assert set(learner) <= set(got)
    assert differing(checksums_as(learner.items(), {k: v[0] for k, v in got.items()}), got) == []
    name = next(k for k in learner if k.endswith("experts.gate_up_proj"))
    with torch.no_grad():
        engine.model.get_parameter(name)[3].mul_(0.5)  # one expert of one layer
    assert differing(checksums_as(learner.items(), {k: v[0] for k, v in got.items()}), engine.weight_checksums()) == [
        name
    ]


def _train(run, tiny_model_dir, *extra) -> int:
    args = [f"output_dir={run}", f"model.path={tiny_model_dir}", "cluster.launcher=local", *TINY_JOB]
    return cli.main(["train", *args, "steps=2", "weights.checksum_every=1", *extra])


@pytest.mark.slow
def test_a_job_whose_engine_keeps_one_expert_stale_stops_naming_the_tensor(tmp_path, tiny_model_dir, monkeypatch):
    assert _train(tmp_path / "clean", tiny_model_dir) == 0  # every push checked, every tensor equal

    stale = "model.layers.1.mlp.experts.down_proj"
    applied = BuiltinEngine.update_weights

    def drops_expert_2(self, version, named_tensors):  # a transport that loses one expert's slice
        before = self.model.get_parameter(stale)[2].clone()
        applied(self, version, named_tensors)
        with torch.no_grad():
            self.model.get_parameter(stale)[2].copy_(before)

    monkeypatch.setattr(BuiltinEngine, "update_weights", drops_expert_2)
    with pytest.raises(
        WeightSyncError, match=rf"holds 1 of the learner's \d+ weight tensors with other values .*: {stale}$"
    ):
        _train(tmp_path / "stale", tiny_model_dir, "weights.check_every=0")
