"""A tiny Llama-3-style HF directory: BPE tokenizer with chat special tokens, no pad token,
tokenizer EOS = <|end_of_text|>, generation_config.eos_token_id = [<|end_of_text|>, <|eot_id|>],
tied embeddings. Usage: python repro/make_model.py OUT_DIR"""
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import PreTrainedTokenizerFast, LlamaConfig, LlamaForCausalLM, GenerationConfig

out = sys.argv[1]
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
corpus = ["What is 2+3? The answer is 5.", "system user assistant You are a helpful math tutor.",
          "Compute 12*7 = 84. Think step by step. #### 42 \\boxed{7}"] * 50
tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                             additional_special_tokens=SPECIAL[2:])
hf.chat_template = TEMPLATE
hf.save_pretrained(out)
cfg = LlamaConfig(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True, bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id)
model = LlamaForCausalLM(cfg)
model.generation_config = GenerationConfig(bos_token_id=hf.bos_token_id,
                                           eos_token_id=[hf.eos_token_id, hf.convert_tokens_to_ids("<|eot_id|>")])
model.save_pretrained(out)
print(out, "vocab", len(hf), "eos", hf.eos_token_id, "eot", hf.convert_tokens_to_ids("<|eot_id|>"), "pad", hf.pad_token_id)
