"""The policy model: any local Hugging Face causal LM directory, or the built-in tiny MoE.

The tiny MoE (Qwen3-MoE, 8 experts, top-2, ~2M parameters, character-level tokenizer) is built in
code, warm-started by a short supervised pass on the example task's demonstrations and cached as an
ordinary HF directory: every other part only ever sees "a local model directory"."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import string
import tempfile
import threading
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from envs import repeat
from slime.config import JobConfig, ModelConfig, RolloutConfig, TinyModelConfig
from slime.config.base import ConfigError
from slime.engines.contract import SamplingParams
from slime.errors import UserError

log = logging.getLogger(__name__)
# transformers' "Loading weights" and "Writing model shards" bars: from every actor of a job (Ray
# prints them as blank `(Learner pid=...)` lines) and for every checkpoint; the job has its own.
transformers.utils.logging.disable_progress_bar()

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelDirError(UserError, ValueError):
    """model.path names no Hugging Face model directory transformers can load."""

    hint = (
        "model.path: a local Hugging Face causal LM directory (config.json with a model_type transformers knows, "
        "weights, tokenizer), or leave it unset for the built-in tiny MoE (README, 'Your own model, data and reward')"
    )


class ModelDirNotFound(ModelDirError, FileNotFoundError):
    """model.path is no directory, or one without config.json."""


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    chars = string.ascii_letters + string.digits + string.punctuation + " \n"
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[3:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_moe(
    t: TinyModelConfig, vocab_size: int, seed: int = 0, pad_token_id: int = 0, eos_token_id: int = 1
) -> torch.nn.Module:
    """The default policy's architecture, randomly initialised from `seed`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=2 * t.hidden_size,
        moe_intermediate_size=t.expert_hidden_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        head_dim=t.hidden_size // t.num_heads,
        num_experts=t.num_experts,
        num_experts_per_tok=t.experts_per_token,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        # Untied: the engines' in-place weight update must reach the output head too.
        tie_word_embeddings=False,
        max_position_embeddings=t.max_position_embeddings,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )
    return Qwen3MoeForCausalLM(config)


def warmstart(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, cfg: ModelConfig) -> dict:
    """Supervised pass on generated demonstrations of the example task (loss on answer tokens)."""
    w = cfg.warmstart
    rng = random.Random(cfg.seed + 1)
    examples = [repeat.make_problem(rng) for _ in range(w.num_examples)]
    encoded = []
    for ex in examples:
        prompt = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(ex["label"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((prompt, answer))
    optim = torch.optim.AdamW(model.parameters(), lr=w.lr)
    model.train()
    losses = []
    for step in range(w.steps):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(w.batch_size)]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, a) in enumerate(batch):
            seq = p + a
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(a)
            attn[i, : len(seq)] = 1
        lr = w.lr * min(1.0, (step + 1) / 20) * (1 - step / max(1, w.steps))
        for g in optim.param_groups:
            g["lr"] = lr
        out = model(input_ids=ids, attention_mask=attn, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    model.eval()
    return {
        "warmstart_first_loss": losses[0] if losses else None,
        "warmstart_last_loss": losses[-1] if losses else None,
    }


def _tiny_cache_key(cfg: ModelConfig) -> str:
    blob = json.dumps(
        {
            "tiny": cfg.tiny.model_dump(),
            "warmstart": cfg.warmstart.model_dump(),
            "seed": cfg.seed,
            "task_version": repeat.TASK_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def check_model_config(path: Path, name: str) -> None:
    """A ModelDirError, its message starting with ``name``, unless transformers reads path's
    config.json: JSON, a mapping, with a model_type it knows (or remote code's auto_map)."""
    config = path / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelDirError(f"{name}: {config} is not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelDirError(f"{name}: {config} is not a JSON object")
    model_type = data.get("model_type")
    if model_type is None and "auto_map" not in data:
        raise ModelDirError(f"{name}: {config} has no model_type (transformers picks the architecture by it)")
    if model_type is not None and model_type not in CONFIG_MAPPING and "auto_map" not in data:
        raise ModelDirError(
            f"{name}: model_type {model_type!r} in {config} is not one transformers {transformers.__version__} "
            "knows (a typo, or a model newer than this transformers)"
        )
    try:
        AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # a bad field, remote code not trusted: whatever transformers says, in one line
        cause = " ".join(str(exc).split())
        cause = cause if len(cause) <= 300 else cause[:297] + "..."
        raise ModelDirError(f"{name}: transformers cannot load {config} ({cause or type(exc).__name__})") from exc


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def check_model_files(path: Path, name: str) -> None:
    """A ModelDirError unless path holds weights and a tokenizer. Without weights every actor's load
    fails; without tokenizer files transformers 5 builds an empty tokenizer of the config's kind
    (a handful of special tokens) and every prompt reads as unknown tokens, silently."""
    files = {f.name for f in path.iterdir()}
    if not files & set(WEIGHT_FILES) and not any(f.endswith(".safetensors") for f in files):
        raise ModelDirError(
            f"{name}: no weights in {path} (none of {', '.join(WEIGHT_FILES)}); save the model there with "
            "model.save_pretrained(path)"
        )
    if not files & set(TOKENIZER_FILES) and not any(f.endswith(".tiktoken") for f in files):
        raise ModelDirError(
            f"{name}: no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)}); save the model's tokenizer "
            "there with tokenizer.save_pretrained(path)"
        )


def ensure_model_dir(cfg: ModelConfig) -> Path:
    """The policy's HF directory: cfg.path as given, or the cached (built on first use) tiny MoE."""
    if cfg.path is not None:
        path = Path(cfg.path).expanduser()
        if not (path / "config.json").is_file():
            where = "no such directory" if not path.exists() else "no config.json there"
            raise ModelDirNotFound(f"model.path={cfg.path}: {where} (expected a local Hugging Face model directory)")
        check_model_config(path, f"model.path={cfg.path}")
        check_model_files(path, f"model.path={cfg.path}")
        return path
    cache_root = Path(cfg.cache_dir).expanduser()
    target = cache_root / f"tiny-moe-{_tiny_cache_key(cfg)}"
    if (target / "config.json").is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    model = build_tiny_moe(cfg.tiny, len(tokenizer), cfg.seed, tokenizer.pad_token_id, tokenizer.eos_token_id)
    started = time.time()
    info = warmstart(model, tokenizer, cfg) if cfg.warmstart.enabled else {}
    info["warmstart_seconds"] = round(time.time() - started, 2)
    tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=".building-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "slime_warmstart.json").write_text(json.dumps(info, indent=2))
    try:
        os.rename(tmp, target)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# transformers' from_pretrained patches class-wide state while it loads (PreTrainedModel.tie_weights,
# torch's init functions, the default dtype) and restores it after: two loads that overlap in one
# process (the local launcher's learner and rollout workers are threads) leave tie_weights a no-op for
# good, and a tied output head on the meta device. One load at a time per process.
HF_LOAD_LOCK = threading.RLock()


def from_pretrained(cls, path: str | Path, **kwargs):
    """cls.from_pretrained(path, **kwargs), one at a time in this process (HF_LOAD_LOCK)."""
    with HF_LOAD_LOCK:
        return cls.from_pretrained(str(path), **kwargs)


def load_tokenizer(path: str | Path, pad_with_eos: bool = True):
    """``pad_with_eos``: a tokenizer without a pad token pads with its EOS (batching needs one); an
    export saves the tokenizer as the base had it."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if pad_with_eos and tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    model, loading = from_pretrained(AutoModelForCausalLM, path, dtype=DTYPES[dtype], output_loading_info=True)
    # transformers initializes what the checkpoint lacks at random and only prints a report: a
    # checkpoint of another architecture than its config.json would train from noise.
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ModelDirError(
            f"the weights in {path} do not fit its config.json ({type(model).__name__}): {len(missing)} of the "
            f"model's tensors are not in the checkpoint ({shown}), and would start at random"
        )
    return model.to(device)


def no_cudnn_attention(device: torch.device) -> None:
    """On CUDA, SDPA never picks cuDNN (a plan per new key length, ~8 ms host time on an H200), for
    engine and learner; process-wide, as a per-call context would race across local-launcher threads."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set the model's own dropout to 0 (its nn.Dropout modules and every float rate its modules hand
    to F.dropout: `attention_dropout`, `residual_dropout`, `resid_pdrop`, `layerdrop`, ...; routers with
    training-mode noise route as in eval mode), as TRL's disable_dropout: RL's pi_old, pi and the
    engine's behaviour logprobs must be one function of the weights. The names of what changed."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            changed.append(name)
        # Every float rate a forward hands to F.dropout, whatever its name: attention_dropout,
        # residual_dropout (StarCoder2, Seed-OSS), embedding_dropout, activation_dropout, resid_pdrop
        # (DBRX), layerdrop (XGLM, BioGPT), ...
        for attr in dict.fromkeys([*(a for a in vars(module) if _is_dropout_rate(a)), *_DROPOUT_NAMES]):
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                setattr(module, attr, 0.0)
                changed.append(f"{name}.{attr}")
        # A router with training-mode noise (a `*jitter*` setting: PhiMoE samples its experts with
        # Gumbel noise and jitters its input in training, Mixtral and MiniMax jitter, DBRX too) runs
        # as in eval mode, the engine's routing, whatever the model's mode.
        if any("jitter" in a for a in vars(module)) and not getattr(module, "_slime_eval_routing", False):
            module.register_forward_pre_hook(_routing_as_in_eval)
            module._slime_eval_routing = True
            changed.append(f"{name} (routing noise in train mode)")
    return changed


def train_mode_gap(model: torch.nn.Module) -> float:
    """The largest gap between the model's logits in training mode (two forwards) and in eval mode
    on a short input, relative to the logits' size: 0 once disable_dropout has done its work. A
    dropout or noise setting it does not know of shows here; the weight-sync probe cannot see it,
    because engine and learner both score the probe in eval mode. The model's mode is kept."""
    was_training = model.training
    param = next(model.parameters())
    vocab = int(getattr(model.config, "vocab_size", 0) or 2)
    ids = (torch.arange(1, 9, device=param.device) % vocab)[None]
    try:
        with torch.no_grad():
            model.eval()
            want = model(input_ids=ids, use_cache=False).logits.float()
            model.train()
            gap = max(
                (model(input_ids=ids, use_cache=False).logits.float() - want).abs().max().item() for _ in range(2)
            )
    finally:
        model.train(was_training)
    return gap / max(want.abs().max().item(), 1e-6)


def _routing_as_in_eval(module: torch.nn.Module, args) -> None:
    module.training = False


def eos_token_ids(tokenizer) -> list[int]:
    """The ids that end a response, as Hugging Face's generate stops: the tokenizer's EOS plus the
    model directory's `eos_token_id` (generation_config.json, else config.json; an id or a list:
    Llama 3's <|eot_id|>, Qwen's <|im_end|>, which a chat model ends its turn with)."""
    ids = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    for extra in _config_eos_ids(getattr(tokenizer, "name_or_path", "") or ""):
        if extra not in ids:
            ids.append(extra)
    return ids


def _config_eos_ids(model_dir: str) -> list[int]:
    d = Path(model_dir).expanduser()
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((d / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):  # no such file (or not a directory), not a JSON object
            continue
        if value is not None:
            return [int(v) for v in (value if isinstance(value, list) else [value])]
    return []


_DROPOUT_NAMES = ("attention_dropout", "dropout", "attn_dropout", "hidden_dropout")  # class attributes too


def _is_dropout_rate(attr: str) -> bool:
    return "dropout" in attr or attr.endswith("pdrop") or attr == "layerdrop"


def stop_token_ids(tokenizer, stop_strings: list[str]) -> list[int]:
    """EOS (every id of `eos_token_ids`) plus each stop string that is a single token (the others
    are matched as text: `multi_token_stops`)."""
    ids = eos_token_ids(tokenizer)
    for s in stop_strings:
        toks = _stop_tokens(tokenizer, s)
        if len(toks) == 1 and toks[0] not in ids:
            ids.append(toks[0])
    return ids


def multi_token_stops(tokenizer, stop_strings: list[str]) -> list[str]:
    """The stop strings of several tokens: engines match them in the response's text."""
    return [s for s in stop_strings if len(_stop_tokens(tokenizer, s)) > 1]


def _stop_tokens(tokenizer, s: str) -> list[int]:
    toks = tokenizer(s, add_special_tokens=False)["input_ids"]
    if not toks:
        raise ConfigError(f"rollout.stop: {s!r} is no token at all (an empty stop string)")
    return toks


def rollout_stop_token_ids(rollout: RolloutConfig, tokenizer) -> list[int]:
    """The tokens that end a response: none with rollout.ignore_eos, else EOS and rollout.stop's
    single-token strings."""
    return [] if rollout.ignore_eos else stop_token_ids(tokenizer, rollout.stop)


def checked_rollout_stops(rollout: RolloutConfig, tokenizer, model_dir: str) -> list[int]:
    """`rollout_stop_token_ids` at a job's start, with a warning when nothing can end a response:
    a tokenizer without an EOS token (a base model's, or one whose chat template ends a turn with
    another token) made every response run to max_new_tokens, silently."""
    ids = rollout_stop_token_ids(rollout, tokenizer)
    if not ids and not rollout.ignore_eos and not rollout_stop_strings(rollout, tokenizer):
        log.warning(
            "the tokenizer of %s has no EOS token and rollout.stop is empty: nothing ends a response before "
            "rollout.max_new_tokens=%d. Set rollout.stop to what ends a turn (e.g. ['<|im_end|>']), or "
            "rollout.ignore_eos=true if running to the budget is meant",
            model_dir,
            rollout.max_new_tokens,
        )
    return ids


def warn_unstopped_turn_end(tokenizer, cfg: JobConfig, records: list, model_dir: str) -> None:
    """Prompts that go through the chat template (data.apply_chat_template, or chat-message rows)
    whose assistant turn ends with a token that is no stop token here (a base model's EOS
    <|endoftext|>, turns closed by <|im_end|>): every response ran on past its turn to the budget,
    and the job said nothing. Text prompts of a base model are not its business."""
    rollout = cfg.rollout
    chat = bool(cfg.data.apply_chat_template) or any(not isinstance(r.prompt, str) for r in records)
    end = chat_turn_end(tokenizer) if chat and not rollout.ignore_eos else None
    if end is not None and end not in rollout_stop_token_ids(rollout, tokenizer):
        name = tokenizer.convert_ids_to_tokens(end)
        log.warning(
            "the chat template of %s ends an assistant turn with %r (id %d), which is no stop token here: a "
            "chat prompt's response runs on past its turn, to rollout.max_new_tokens. Add rollout.stop=[%r]",
            model_dir,
            name,
            end,
            name,
        )


def chat_turn_end(tokenizer) -> int | None:
    """The special token the chat template closes an assistant turn with (`<|im_end|>`,
    `<|eot_id|>`), or None: no template, or plain text after the turn."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "SLIME_TURN_END_PROBE"
    try:
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # a template that wants other roles or fields: nothing to say
        return None
    tail = text[text.find(marker) + len(marker) :] if marker in text else ""
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail.strip() else []
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    return int(ids[0]) if ids and int(ids[0]) in special else None


def rollout_stop_strings(rollout: RolloutConfig, tokenizer) -> list[str]:
    """rollout.stop's strings of several tokens (none with rollout.ignore_eos)."""
    return [] if rollout.ignore_eos else multi_token_stops(tokenizer, rollout.stop)


def rollout_sampling_params(rollout: RolloutConfig, tokenizer) -> SamplingParams:
    """The rollout's sampling: temperature, top-p, top-k, the response budget, the stop tokens and
    stop strings."""
    return SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=rollout_stop_token_ids(rollout, tokenizer),
        stop_strings=rollout_stop_strings(rollout, tokenizer),
    )
