"""The decoder families the installed transformers can build tiny (slime/engines/families.py):
found from the causal-LM registry, shrunk by their config's field names, refused with a reason."""

from __future__ import annotations

import pytest
import torch

from slime.engines.families import FAMILIES, _refusal_before_building, tiny_model


@pytest.mark.parametrize("family", ["olmo2", "cohere", "granitemoe", "deepseek_v32"])
def test_a_family_outside_the_curated_list_builds_tiny_from_its_config_fields(family):
    assert family not in FAMILIES
    model = tiny_model(family)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, 97)


@pytest.mark.parametrize(
    "family,reason", [("bart", "encoder-decoder"), ("bert", "encoder family"), ("llama4", "multimodal")]
)
def test_encoder_decoders_encoders_and_multimodal_composites_are_refused_unbuilt(family, reason):
    assert reason in _refusal_before_building(family)
    assert _refusal_before_building("llama") is None
