"""The built-in engine: continuous batching in torch, the reference engine of the contract.

engine.py holds `BuiltinEngine` (the scheduler and the contract's methods); fast_decoder.py the
hand-written decode over a paged cache for the decoder families it fits (decoder_layers.py,
generic_decoder.py), with decode_graphs.py replaying its static steps as CUDA graphs;
hf_batch.py the transformers path for models it does not fit; token_sampler.py the sampler;
lora_merge.py LoRA pushes merged into the weights;
start_check.py the start-up check that the fast path agrees with the model; local_generator.py a
blocking generate() over the engine (the LLM judge, `slime.tools.openai_server`)."""

from slime.engines.builtin.engine import BuiltinEngine

__all__ = ["BuiltinEngine"]
