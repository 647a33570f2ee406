"""LoRA in the learner (`learner.lora`, docs/learner.md "LoRA"): peft's adapters in the policy.

- **Injection.** `apply_lora` checks the targets against the model first (LoraError: an entry that
  matches nothing, a match that is not an nn.Linear, a rank above a layer's size), then calls
  peft's `inject_adapter_in_model`. The model keeps its Hugging Face class and module names; each
  adapted nn.Linear becomes a peft `lora.Linear` around it. Only the adapters require grad.
- **Reference.** `adapters_disabled` turns every LoRA layer off: the policy module is then the
  frozen base, which is the KL reference (`as_reference`: also eval mode). No second copy.
- **Push contract.** `adapter_tensors` yields, for every adapted module `{module}` (its name in
  the plain model, e.g. `model.layers.0.self_attn.q_proj`), `{module}.lora_A.weight` [r, in] and
  `{module}.lora_B.weight` [out, r]: peft's saved key format, without the adapter name. An engine's
  weight is then W_base + (alpha / rank) * B @ A. Every push carries all of them, the first too.
- **Checkpoints.** `adapter/` (`adapter_model.safetensors` + `adapter_config.json`, what
  `peft.PeftModel.from_pretrained(base, path)` loads) and `base_model.json` (the base directory and
  the sha256 of its weight files, `base_model_hash`). `check_checkpoint` refuses, before anything is
  read, a checkpoint of another base, of other adapter settings, or of the other kind (LoRA or full).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch

from slime.config import ConfigError, LoraSettings
from slime.learner import sharding
from slime.learner.sharding import CheckpointError

ADAPTER_DIR = "adapter"  # inside a learner checkpoint: the adapters in PEFT's format
BASE_INFO = "base_model.json"  # inside a learner checkpoint: the base model the adapters belong to
ADAPTER_NAME = "default"  # peft's adapter name; it never appears in a pushed or saved name
WEIGHT_FILES = (".safetensors", ".bin")


class LoraError(ConfigError):
    """learner.lora cannot be applied to this model; names the entry, the module and why."""

    hint = "learner.lora.target_modules, rank and layers are described in docs/learner.md, section LoRA"


# ---- injection --------------------------------------------------------------------------------
def peft_config(settings: LoraSettings, modules: list[str], base_model: str | None = None):
    """peft's LoraConfig for the modules check_targets found, by their full names (an exact match in
    peft). Not the entries as given: on MoE models peft 0.21 rewrites target_modules for
    transformers 5 (a regex becomes the leaf names it matched, in every layer), which would adapt
    other modules than the ones checked. learner.lora.layers is already applied in the list."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(modules),
        bias="none",
        use_rslora=False,
        init_lora_weights=True,  # A random, B = 0: the first push leaves every engine at the base
        base_model_name_or_path=base_model,
    )


def _matches(target: str | list[str], name: str, layers: list[int] | None) -> bool:
    """peft's own test (check_target_module_exists) of one module name against target_modules."""
    from peft.tuners.tuners_utils import check_target_module_exists

    config = SimpleNamespace(
        target_modules=target,
        layers_to_transform=layers,
        layers_pattern=None,
        exclude_modules=None,
        modules_to_save=None,
        target_parameters=None,
    )
    return bool(check_target_module_exists(config, name))


def _layer_of(name: str) -> int | None:
    match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)  # peft's layer index: the first number
    return int(match.group("idx")) if match else None


def check_targets(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """The modules `settings` adapts, in the model's order; a LoraError naming the cause otherwise."""
    modules = dict(model.named_modules())
    linear = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)]
    suffixes = ", ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in linear))
    regex = isinstance(settings.target_modules, str)  # one regex, matched in full; else suffixes
    entries = [settings.target_modules] if regex else list(settings.target_modules)
    where = f" in layers {settings.layers}" if settings.layers is not None else ""
    matched: dict[str, str] = {}  # module -> the entry that matched it
    for entry in entries:
        target = entry if regex else [entry]
        names = [n for n in modules if n and _matches(target, n, settings.layers)]
        if not names:
            raise LoraError(
                f"learner.lora.target_modules: {entry!r} matches no module of {type(model).__name__}{where}"
                f"{_parameter_note(model, target)}; its nn.Linear modules end with: {suffixes}"
            )
        matched.update({n: entry for n in names if n not in matched})
    for name, entry in matched.items():
        module = modules[name]
        if not isinstance(module, torch.nn.Linear):
            raise LoraError(
                f"learner.lora.target_modules: {entry!r} matches {name} ({type(module).__name__}), which is not "
                f"an nn.Linear; LoRA adapts nn.Linear modules only{_experts_note(module)} (nn.Linear modules "
                f"end with: {suffixes})"
            )
        if settings.rank > min(module.in_features, module.out_features):
            raise LoraError(
                f"learner.lora.rank={settings.rank} exceeds the size of {name}: nn.Linear {module.in_features} -> "
                f"{module.out_features} (weight [{module.out_features}, {module.in_features}]); the rank can be at "
                f"most min(in, out) = {min(module.in_features, module.out_features)} for every adapted layer"
            )
    if settings.layers is not None:
        found = {_layer_of(n) for n in matched}
        absent = sorted(set(settings.layers) - found)
        if absent:
            layers = sorted(i for i in {_layer_of(n) for n in linear} if i is not None)
            raise LoraError(
                f"learner.lora.layers: no target module in layer(s) {absent} (the model's layers: "
                f"{layers[0] if layers else '-'}..{layers[-1] if layers else '-'})"
            )
    return [n for n in modules if n in matched]  # the model's order


def check_model_dir(model_dir: str | Path, settings: LoraSettings) -> list[str]:
    """apply_lora on a model directory's architecture, built on the meta device (no weight is read):
    the job runs it at start, so a bad target fails before any actor starts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        return apply_lora(model, settings)


def _parameter_note(model: torch.nn.Module, target: str | list[str]) -> str:
    """When the entry names a parameter rather than a module (fused MoE experts), say so."""
    for name, param in model.named_parameters():
        if _matches(target, name, None) and param.dim() == 3:
            return (
                f" (it names the parameter {name} {list(param.shape)}: MoE experts are fused 3-D parameters in "
                "transformers 5, not nn.Linear modules, and LoRA on MoE experts is not supported)"
            )
    return ""


def _experts_note(module: torch.nn.Module) -> str:
    fused = [(n, p) for n, p in module.named_parameters() if p.dim() == 3]
    if fused:
        n, p = fused[0]
        return (
            f"; it holds MoE experts as fused 3-D parameters ({n} {list(p.shape)}), and LoRA on MoE experts is "
            "not supported: adapt the attention (q_proj, k_proj, v_proj, o_proj)"
        )
    return ""


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """Check the targets, then inject the adapters (peft); returns the adapted modules' names."""
    from peft import inject_adapter_in_model

    names = check_targets(model, settings)
    try:
        inject_adapter_in_model(peft_config(settings, names), model, adapter_name=ADAPTER_NAME)
    except ValueError as exc:  # peft's own refusal (e.g. its MoE conversion, below)
        raise LoraError(f"learner.lora.target_modules: peft cannot adapt {_few(names)}: {exc}") from exc
    adapted = adapted_modules(model)
    if adapted != names:
        # On MoE models peft maps the names of transformers 4's expert modules (gate_proj, up_proj,
        # down_proj, gate, w1...) onto transformers 5's fused experts, even where they name nn.Linear
        # modules (a shared expert's): that would be LoRA on the experts.
        raise LoraError(
            f"learner.lora.target_modules: peft adapted {_few(adapted)} where the targets name {_few(names)}: on "
            f"{getattr(model.config, 'model_type', 'this')} models peft maps transformers 4's MoE expert names "
            "(gate_proj, up_proj, down_proj, gate) onto the fused experts, and LoRA on MoE experts is not "
            "supported; target other modules (attention: q_proj, k_proj, v_proj, o_proj)"
        )
    return names


def adapted_modules(model: torch.nn.Module) -> list[str]:
    """The names of the model's peft LoRA layers, in its order."""
    return [n for n, m in model.named_modules() if _is_lora_layer(m)]


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" (and {len(names) - 4} more)" if len(names) > 4 else "")


def _is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


# ---- the reference ----------------------------------------------------------------------------
@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Every peft LoRA layer off (peft's enable_adapters), then back as it was: the frozen base.
    Which parameters require grad stays as it was throughout: peft's enable_adapters(False) also
    freezes the adapters, and FSDP2 fixes a unit's gradient dtypes from its trainable parameters at
    its first forward (with mixed precision, a first forward that saw none would reduce in bf16)."""
    layers = [m for m in model.modules() if _is_lora_layer(m)]
    was_off = [m.disable_adapters for m in layers]
    grads = [(p, p.requires_grad) for m in layers for p in m.parameters()]
    for m in layers:
        m.enable_adapters(False)
    for p, requires_grad in grads:
        p.requires_grad_(requires_grad)
    try:
        yield model
    finally:
        for m, off in zip(layers, was_off):
            m.enable_adapters(not off)
        for p, requires_grad in grads:
            p.requires_grad_(requires_grad)


@contextlib.contextmanager
def as_reference(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The KL reference: eval mode and the adapters off (a model without LoRA: only eval mode)."""
    training = model.training
    model.eval()
    try:
        with adapters_disabled(model):
            yield model
    finally:
        model.train(training)


# ---- the adapters' tensors --------------------------------------------------------------------
def public_name(name: str) -> str | None:
    """`{module}.lora_A.default.weight` -> `{module}.lora_A.weight`; None for any other parameter."""
    for part in ("lora_A", "lora_B"):
        inner = f".{part}.{ADAPTER_NAME}.weight"
        if name.endswith(inner):
            return name[: -len(inner)] + f".{part}.weight"
    return None


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(public name, parameter) of every adapter, in the model's order: what a push carries. Sharded,
    the parameters are DTensors, gathered by whoever reads them (every rank, in this order)."""
    for name, param in model.named_parameters():
        public = public_name(name)
        if public is not None:
            yield public, param


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as whole CPU tensors under their public names (sharded: gathered, a collective)."""
    return {n: sharding.full_tensor(p.detach()).cpu().clone() for n, p in adapter_tensors(model)}


def adapter_state_for(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Adapter tensors under public names -> the model's own parameter names, every adapter given
    with its shape (a partial state dict: load_state_dict(strict=False) or sharding.load_full)."""
    params = {public_name(n): (n, p) for n, p in model.named_parameters() if public_name(n) is not None}
    missing, unexpected = sorted(params.keys() - state.keys()), sorted(state.keys() - params.keys())
    if missing or unexpected:
        raise CheckpointError(f"{source}: adapters missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, (_, param) in params.items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise CheckpointError(f"{source}: adapter {name} is {list(state[name].shape)}, not {list(param.shape)}")
    return {params[name][0]: tensor for name, tensor in state.items()}


# ---- checkpoints -------------------------------------------------------------------------------
PEFT_PREFIX = "base_model.model."  # PEFT's saved keys: the PeftModel's names of the adapters


def save_adapter(directory: Path, model: torch.nn.Module, settings: LoraSettings, model_dir: str, write: bool) -> None:
    """`adapter/` in PEFT's format and `base_model.json`. Sharded, every rank calls this (the gathers
    are collectives) and rank 0 writes (`write`)."""
    from safetensors.torch import save_file

    state = adapter_state(model)
    if not write:
        return
    target = directory / ADAPTER_DIR
    target.mkdir(parents=True, exist_ok=True)
    # Keyed as PeftModel.save_pretrained keys them ("base_model.model.{module}..."): PEFT adds that
    # prefix on load only for models transformers converts (MoE), so dense models need it on disk.
    save_file(
        {PEFT_PREFIX + n: t.contiguous() for n, t in state.items()},
        str(target / "adapter_model.safetensors"),
        {"format": "pt"},
    )
    peft_config(settings, adapted_modules(model), str(model_dir)).save_pretrained(str(target))
    files = [p.name for p in _weight_files(Path(model_dir))]
    info = {"model_dir": str(Path(model_dir).resolve()), "sha256": base_model_hash(model_dir), "weight_files": files}
    (directory / BASE_INFO).write_text(json.dumps(info, indent=2) + "\n")


def read_adapter(directory: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's adapter tensors under their public names."""
    from safetensors.torch import load_file

    state = load_file(str(directory / ADAPTER_DIR / "adapter_model.safetensors"))
    return {n.removeprefix(PEFT_PREFIX): t for n, t in state.items()}  # checkpoints before the prefix too


def check_checkpoint(directory: Path, settings: LoraSettings | None, model: torch.nn.Module, model_dir: str) -> None:
    """Refuse, before anything is loaded, a checkpoint this learner cannot continue: LoRA adapters
    into full fine-tuning or the reverse, adapters of other settings or modules, or of another base."""
    is_lora = (directory / ADAPTER_DIR).is_dir()
    if is_lora and settings is None:
        raise CheckpointError(
            f"{directory} holds LoRA adapters ({ADAPTER_DIR}/), but learner.lora is not set: set learner.lora as "
            f"the checkpoint was trained (rank, alpha and modules in {ADAPTER_DIR}/adapter_config.json)"
        )
    if not is_lora:
        if settings is not None:
            raise CheckpointError(
                f"{directory} holds a fully fine-tuned policy (no {ADAPTER_DIR}/), but learner.lora is set: "
                "unset learner.lora to resume it, or start LoRA from a base model (model.path)"
            )
        return
    saved = json.loads((directory / ADAPTER_DIR / "adapter_config.json").read_text())
    differ = []
    for key, field, want in (("r", "rank", settings.rank), ("lora_alpha", "alpha", settings.alpha)):
        if saved.get(key) != want:
            differ.append(f"{field}: checkpoint {saved.get(key)}, config {want}")
    saved_modules, modules = sorted(saved.get("target_modules") or []), sorted(adapted_modules(model))
    if saved_modules != modules:
        only_saved, only_here = sorted(set(saved_modules) - set(modules)), sorted(set(modules) - set(saved_modules))
        differ.append(
            f"adapted modules: only the checkpoint's {_few(only_saved)}; only this config's {_few(only_here)}"
        )
    if differ:
        raise CheckpointError(f"{directory}: its adapters differ from learner.lora ({'; '.join(differ)})")
    base = json.loads((directory / BASE_INFO).read_text())
    digest = base_model_hash(model_dir)
    if base["sha256"] != digest:
        raise CheckpointError(
            f"{directory}: its adapters were trained on the base model {base['model_dir']} (sha256 "
            f"{base['sha256']}), but this job's base model {Path(model_dir).resolve()} has sha256 {digest}: "
            "adapters apply only to the weights they were trained on"
        )


def merged_policy(checkpoint: Path, model_dir: str | Path, dtype: str = "float32") -> torch.nn.Module:
    """A LoRA checkpoint's policy as one plain Hugging Face model: the base with the adapters merged
    into its weights (W + alpha / rank * B @ A); what an export of the checkpoint holds."""
    from peft import PeftModel

    from slime.model import load_model

    base = json.loads((checkpoint / BASE_INFO).read_text())
    digest = base_model_hash(model_dir)
    if base["sha256"] != digest:
        raise CheckpointError(
            f"{checkpoint}: its adapters were trained on {base['model_dir']} (sha256 {base['sha256']}), not on "
            f"{Path(model_dir).resolve()} (sha256 {digest})"
        )
    with warnings.catch_warnings():  # PEFT calls transformers 5's deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = PeftModel.from_pretrained(load_model(model_dir, dtype), str(checkpoint / ADAPTER_DIR))
        return model.merge_and_unload()


# ---- the base model's hash ----------------------------------------------------------------------
def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(
        (p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(WEIGHT_FILES)), key=lambda p: p.name
    )


def default_hash_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "slime-april" / "base_model_hashes.json"


def base_model_hash(model_dir: str | Path, cache: Path | None = None) -> str:
    """sha256 over the bytes of the directory's weight files (*.safetensors, *.bin), in sorted name
    order (`cat` of them, LC_ALL=C order, into sha256sum). Cached per directory, keyed by each file's
    name, size and mtime, so a large base is read once (default: ~/.cache/slime-april/)."""
    model_dir = Path(model_dir).resolve()
    files = _weight_files(model_dir)
    stats = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    cache = cache or default_hash_cache()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(str(model_dir)) if isinstance(known, dict) else None
    if isinstance(entry, dict) and entry.get("files") == stats:
        return str(entry["sha256"])
    digest = hashlib.sha256()
    for p in files:
        with p.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    known = known if isinstance(known, dict) else {}
    known[str(model_dir)] = {"files": stats, "sha256": digest.hexdigest()}
    try:  # a cache that cannot be written only costs the next reader a hash
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, cache)
    except OSError:
        pass
    return digest.hexdigest()
