"""Like make_model.py, but the weights are set so that greedy OR sampled decoding is deterministic:
after any token the model writes "5", and after "5" it writes <|eot_id|> (the chat turn's end, listed
in generation_config.eos_token_id but not the tokenizer's eos_token). A correct rollout answers "5".
Usage: python repro/make_chain_model.py OUT_DIR"""
import subprocess, sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, GenerationConfig

out = sys.argv[1]
subprocess.run([sys.executable, __file__.replace("make_chain_model", "make_model"), out], check=True)
tok = AutoTokenizer.from_pretrained(out)
V = len(tok); D = 304
five = tok("5", add_special_tokens=False)["input_ids"]; assert len(five) == 1, five
five = five[0]; eot = tok.convert_tokens_to_ids("<|eot_id|>")
cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
m = LlamaForCausalLM(cfg)
with torch.no_grad():
    m.model.embed_tokens.weight.zero_(); m.model.embed_tokens.weight[:, :V] = torch.eye(V)
    for layer in m.model.layers:
        layer.self_attn.o_proj.weight.zero_(); layer.mlp.down_proj.weight.zero_()
    m.lm_head.weight.zero_()
    m.lm_head.weight[five, :V] = 1.0      # every token -> "5"
    m.lm_head.weight[five, five] = 0.0
    m.lm_head.weight[eot, five] = 2.0     # "5" -> <|eot_id|>
m.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, eot])
m.save_pretrained(out)
ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_dict=False)
g = m.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
print("HF generate (honours generation_config eos list):", repr(tok.decode(g[0, len(ids):])))
