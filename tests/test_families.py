"""The decoder families the installed transformers can build tiny (benchmarks/families.py):
found from the causal-LM registry, shrunk by their config's field names, refused with a reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.families import FAMILIES, _refusal_before_building, buildable_families, tiny_model
from slime.engines.builtin import BuiltinEngine
from slime.engines.builtin.decoder_tree import trace_decoder
from slime.engines.builtin.fast_decoder import FastDecoder, _column_order
from slime.engines.builtin.generic_decoder import attention_inputs
from slime.engines.builtin.start_check import agrees_with_model
from slime.engines.contract import GenerationRequest, SamplingParams


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


TIE_LOGIT_GAP = 5e-4  # a tie: the engine agrees with the model within 2e-4 per logprob (test_generic_decoder)


def engine_and_generate_tokens(model, forward: str | None = None) -> tuple[str, list[list[int]], list[list[int]]]:
    """The engine's path and greedy tokens beside `model.generate`'s, on 4 unequal prompts. Where the
    two first differ at a near-tie of the model's own logits (a random tiny model has some), the
    engine's row is cut there and so is generate's: past a tie both continuations are right."""
    from tests.test_generic_decoder import greedy_with_hf_generate, prompts

    engine = BuiltinEngine(model, max_running_requests=8, max_seq_len=128)
    ps = prompts(4, seed=5, lo=2, hi=14)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[])
    out = engine.generate([GenerationRequest(f"r{i}", p, greedy) for i, p in enumerate(ps)])
    got = [out[f"r{i}"].token_ids for i in range(len(ps))]
    want = [greedy_with_hf_generate(model, p, 10) for p in ps]
    for row, (prompt, g, w) in enumerate(zip(ps, got, want)):
        first = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if first is None:
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + w[:first]])).logits[0, -1].float()
        if abs(float(logits[g[first]] - logits[w[first]])) < TIE_LOGIT_GAP:
            got[row], want[row] = g[:first], w[:first]
    return engine.health()["forward"], got, want


def assert_hand_written_with_generates_tokens_and_in_bf16(model) -> None:
    """The hand-written layers, token for token `generate` (float32), and still chosen in bf16."""
    forward, got, want = engine_and_generate_tokens(model)
    assert forward == "fast"
    assert got == want
    assert BuiltinEngine(model.to(torch.bfloat16), max_running_requests=4).health()["forward"] == "fast"


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("family", ["olmo2", "cohere", "granite", "granitemoe", "vaultgemma", "apertus"])
def test_post_norm_parallel_and_scaled_layers_take_the_hand_written_path_with_generates_tokens(family):
    """Post-norm (OLMo 2), parallel attention + MLP with a LayerNorm (Cohere), embedding /
    residual / logit scales off 1 (Granite, and its MoE under another name), norms under other
    names (VaultGemma, Apertus): the hand-written layers, token for token `generate`; in bf16 too
    (OLMo 2's rotary tables are float32: its queries and keys are cast back after the rotation)."""
    assert_hand_written_with_generates_tokens_and_in_bf16(tiny_model(family))


@pytest.mark.usefixtures("one_torch_thread")
def test_a_residual_scale_and_latent_attentions_rope_are_read_off_what_the_model_computes():
    """MiniCPM3 adds x + (scale_depth / sqrt(layers)) * branch under an attribute name of its own,
    and its latent attention turns RoPE on halves where DeepSeek's turns interleaved pairs (its
    config says neither): both read off the traced values; the hand-written layers then give
    `generate`'s tokens, in bf16 too. Granite's residual_multiplier and DeepSeek's pairs still hold."""
    # GLM-4-MoE-lite: neither reading reproduces its captured queries exactly; its config's stays.
    cases = (("minicpm3", "halves"), ("deepseek_v3", "pairs"), ("glm4_moe_lite", "pairs"), ("granite", "halves"))
    for family, rotary in cases:
        model = tiny_model(family)
        trace = trace_decoder(model)
        layer = trace.layer_modules[0]
        expected = getattr(layer, "residual_scale", getattr(layer, "residual_multiplier", 1.0))
        assert {flow.residual_scale for flow in trace.layers} == {expected}  # exact, not a fitted float
        fast = FastDecoder(model, 4, 64)
        fast.fit_attention(attention_inputs(model, fast.attention_modules))
        assert {L.rotary for L in fast.layers} == {rotary}
        assert agrees_with_model(model, fast) is None
    assert expected != 1.0  # Granite's multiplier is off 1 at this size
    assert_hand_written_with_generates_tokens_and_in_bf16(tiny_model("minicpm3"))


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    "family,modes,halves_refused",
    [
        ("glm", ["pairs", "pairs"], True),  # interleaved pairs, the table in halves (Llama's layout)
        # Interleaved pairs, the table already in pairs. Its logit scale (1/16) keeps a halves
        # reading under the check's 1e-3 at this size; at hidden 256 it was refused (2.2e-3).
        ("cohere", ["pairs", "pairs"], False),
        ("exaone4", ["halves", "none"], True),  # its full-attention layers have no RoPE
        ("flint", ["none", "halves"], True),  # only its sliding-window layers are rotary
        ("llama", ["halves", "halves"], False),
    ],
)
def test_each_layers_rotary_mode_is_read_off_the_models_own_attention(family, modes, halves_refused):
    """RoPE on halves, on interleaved pairs, or none, per layer: read from the queries and keys the
    model's own attention computes. The hand-written layers then give `generate`'s tokens, and the
    halves reading everywhere is refused by the start check."""
    model = tiny_model(family)
    forward, got, want = engine_and_generate_tokens(model)
    assert forward == "fast"
    assert got == want
    fast = FastDecoder(model, 4, 64)
    fast.fit_attention(attention_inputs(model, fast.attention_modules))
    assert [L.rotary for L in fast.layers] == modes
    assert agrees_with_model(model, fast) is None
    if halves_refused:
        for L in fast.layers:
            L.rotary = "halves"
        fast.any_pairs = False
        assert "logits differ" in agrees_with_model(model, fast)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("family", ["hunyuan_v1_dense", "hunyuan_v1_moe"])
def test_q_and_k_norms_under_other_names_after_the_rotation_are_found_by_their_effect(family):
    """HunYuan norms each head's queries and keys after RoPE, in modules called query_layernorm and
    key_layernorm: which norm is whose, and that it comes after the rotation, is read off the
    model's own queries and keys, not off the names."""
    model = tiny_model(family)
    forward, got, want = engine_and_generate_tokens(model)
    assert forward == "fast"
    assert got == want
    fast = FastDecoder(model, 4, 64)
    with fast.loose_norms_told_apart():
        fast.fit_attention(attention_inputs(model, fast.attention_modules))
    attn = model.model.layers[0].self_attn
    L = fast.layers[0]
    assert L.qk_norm_after_rotary
    assert L.q_norm[0] is attn.query_layernorm.weight and L.k_norm[0] is attn.key_layernorm.weight
    assert torch.equal(attn.query_layernorm.weight, torch.ones(16)), "the doubling is undone"
    qwen3 = FastDecoder(tiny_model("qwen3"), 4, 64)  # its q/k norms come before the rotation
    qwen3.fit_attention(attention_inputs(qwen3.model, qwen3.attention_modules))
    assert not any(L.qk_norm_after_rotary for L in qwen3.layers)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("family", ["mimo_v2_flash", "minimax_m2"])
def test_per_layer_kv_heads_scaled_values_and_a_router_with_more_inputs_take_the_hand_written_path(family):
    """MiMo-V2-Flash: twice the kv heads on its sliding layers, values of another size, scaled by
    `attention_value_scale` (read off the model as a multiple); MiniMax-M2: a router that reads its
    block's score correction, so the block runs as the model's own module."""
    model = tiny_model(family)
    forward, got, want = engine_and_generate_tokens(model)
    assert forward == "fast"
    assert got == want
    if family == "mimo_v2_flash":
        fast = FastDecoder(model, 4, 64)
        fast.fit_attention(attention_inputs(model, fast.attention_modules))
        assert {L.kv_heads for L in fast.layers} == {2, 4}
        assert [L.v_scale for L in fast.layers] == pytest.approx([model.config.attention_value_scale] * 2)
    # In bf16 the scale is read within bf16's rounding, and the logit check still passes.
    assert BuiltinEngine(model.to(torch.bfloat16), max_running_requests=4).health()["forward"] == "fast"


def test_the_trace_reads_where_each_layer_applies_its_norms_and_scales():
    olmo2 = trace_decoder(tiny_model("olmo2")).layers[0]
    assert (olmo2.attn_in, olmo2.attn_out, olmo2.mlp_in, olmo2.mlp_out) == (
        None,
        "post_attention_layernorm",
        None,
        "post_feedforward_layernorm",
    )
    cohere = trace_decoder(tiny_model("cohere")).layers[0]
    assert cohere.parallel and cohere.attn_in == "input_layernorm" and cohere.mlp_in is None
    granite = trace_decoder(tiny_model("granitemoe"))
    assert granite.layers[0].mlp == "block_sparse_moe" and granite.layers[0].residual_scale == 0.5
    assert granite.embed_scale == pytest.approx(2.0) and granite.logit_scale == pytest.approx(0.5)
    llama = trace_decoder(tiny_model("llama"))
    assert (llama.layers[0].attn_in, llama.layers[0].mlp_in) == ("input_layernorm", "post_attention_layernorm")
    assert "one MLP expected" in trace_decoder(tiny_model("ergo"))  # gated residuals


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    "family,fused,rotary,positions",
    [
        ("gpt2", "contiguous", "none", True),  # transformer.wte / wpe / h / ln_f, Conv1D [q; k; v]
        ("gpt_bigcode", "contiguous", "none", True),  # one key and value head in the fused projection
        ("gpt_neox", "per_head", "halves", False),  # per head [q, k, v]; the MLP beside with a norm of its own
        ("falcon", "contiguous", "halves", False),  # its layer adds the attention into the MLP's output in place
        ("persimmon", "per_head", "halves", False),  # LayerNorms on each head's queries and keys
        ("gptj", None, "pairs", False),  # a rotary module that gives (sin, cos), angles listed once
        ("codegen", "columns", "pairs", False),  # its fused projection: [q, v, k] in each quarter
        ("phi", None, "halves", False),  # final_layernorm, an output projection named dense, a head bias
        ("opt", None, "none", True),  # fc1 / fc2 called by the layer itself; queries scaled before attention
        ("biogpt", None, "none", True),  # the same, with a scaled embedding and position 0 at row 2
    ],
)
def test_gpt2_style_trees_take_the_hand_written_layers_found_by_their_place_in_the_data_flow(
    family, fused, rotary, positions
):
    """Decoders outside Llama's ``model.model`` tree: the embedding, a learned position table, the
    layer list, the final norm, the head, each layer's attention and its projections are found in
    one traced forward, by what reads what, not by name. Token for token `generate`."""
    model = tiny_model(family)
    trace = trace_decoder(model)
    assert trace.final_norm is not None and (trace.positions is not None) == positions
    assert (trace.rotary is None) == (rotary == "none")
    fast = FastDecoder(model, 4, 64)
    fast.fit_attention(attention_inputs(model, fast.attention_modules))
    assert {L.fused for L in fast.layers} == {fused}
    assert rotary in {L.rotary for L in fast.layers}
    assert agrees_with_model(model, fast) is None
    if family == "opt":
        assert trace.position_offset == 2 and trace.layers[0].mlp_chain == ["fc1", "activation_fn", "fc2"]
        assert trace.layers[0].scaling == 1.0 and fast.layers[0].scaling == pytest.approx(fast.head_dim**-0.5)
    # In bf16 the trace compares within bf16's rounding (GPT-NeoX sums its branches in another order).
    assert_hand_written_with_generates_tokens_and_in_bf16(model)


def test_a_fused_projection_in_any_column_order_is_read_off_its_outputs():
    """Where the fused projection is neither [q; k; v] nor per head, the order of its columns is
    read off its outputs at position 0 (where RoPE turns nothing): on GPT-NeoX that finds the per-head
    layout, on CodeGen its quarters; queries the projection does not give have no order."""
    for family in ("gpt_neox", "codegen"):
        model = tiny_model(family)
        fast = FastDecoder(model, 4, 64)
        L = fast.layers[0]
        h, q, k, v = attention_inputs(model, fast.attention_modules)[0]
        with torch.no_grad():
            fused = F.linear(h, L.w_qkv, L.b_qkv)
        columns = _column_order(fused, q, k, v)
        assert columns is not None and sorted(columns.tolist()) == list(range(fused.shape[-1]))
        if family == "gpt_neox":
            per_head = torch.arange(fused.shape[-1]).view(L.kv_heads, -1, fast.head_dim)
            expected = torch.cat(
                [per_head[:, :-2].reshape(-1), per_head[:, -2].reshape(-1), per_head[:, -1].reshape(-1)]
            )
            assert torch.equal(columns, expected)
        assert _column_order(fused, q + 0.5, k, v) is None
        later_values_off = v.clone()
        later_values_off[1:] += 0.5
        assert _column_order(fused, q, k, later_values_off) is None  # values agree at every position


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    "family,out_norm,gate",
    [("bitnet", "attn_sub_norm", None), ("afmoe", None, "sigmoid"), ("laguna", None, "softplus")],
)
def test_a_norm_or_a_gate_between_the_attention_and_its_output_projection_is_found_and_computed(family, out_norm, gate):
    """What the output projection reads, from the traced attention function's output: a norm of
    the attention's own (BitNet), or the output scaled by a gate, one more projection of the
    attention's input through a sigmoid (AFMoE) or a softplus (Laguna), which then is no q/k/v."""
    model = tiny_model(family)
    flow = trace_decoder(model).layers[0]
    assert flow.out_norm == out_norm and len(flow.qkv) == 3
    assert (flow.out_gate is None) == (gate is None)
    assert gate is None or flow.gate_activation == gate
    assert_hand_written_with_generates_tokens_and_in_bf16(model)
    # In bf16 the closest gate wins, not the first within bf16's tolerance (AFMoE once took q_proj).
    bf16 = FastDecoder(model, 4, 64)
    assert [L.flow.out_gate for L in bf16.layers] == [flow.out_gate] * len(bf16.layers)
    # MiniCPM5-MoE's gate comes out of its query projection: none of these; the generic path takes it.
    assert "neither the attention's output nor a norm or gate" in trace_decoder(tiny_model("minicpm5_moe"))


@pytest.mark.usefixtures("one_torch_thread")
def test_a_norm_before_the_first_layer_weightless_qk_norms_and_rope_turned_the_other_way_are_read_off_nanochat():
    """nanochat: one norm module before the first layer and after the last, q/k norms without a
    weight (per head or over the projection: the fit tries both), and a rotate_half that turns by
    minus the angle."""
    model = tiny_model("nanochat")
    trace = trace_decoder(model)
    assert trace.embed_norm is trace.final_norm is not None
    fast = FastDecoder(model, 4, 64)
    fast.fit_attention(attention_inputs(model, fast.attention_modules))
    assert {(L.rotary_sign, L.qk_norm_per_head, L.qk_norm_after_rotary) for L in fast.layers} == {(-1, True, True)}
    assert_hand_written_with_generates_tokens_and_in_bf16(model)


@pytest.mark.slow
def test_every_buildable_family_on_a_fast_path_gives_generates_greedy_tokens():
    """Every family the installed transformers builds tiny: where the engine takes the hand-written
    or the generic path, its greedy tokens are `model.generate`'s."""
    checked = 0
    for family, overrides in buildable_families().items():
        model = tiny_model(family, **overrides)
        try:
            forward, got, want = engine_and_generate_tokens(model)
        except Exception:  # generate or the Hugging Face path fails on this family: not a fast path
            try:
                assert BuiltinEngine(model, max_running_requests=8).health()["forward"] == "hf", family
            except ValueError as exc:  # refused at start (a state-space or hybrid cache, ...)
                assert "on the Hugging Face path" in str(exc), family
            continue
        if forward in ("fast", "generic"):
            assert got == want, family
            checked += 1
    assert checked >= 90
