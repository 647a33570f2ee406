"""`slime export RUN_DIR [--step N] --out DIR`: a Hugging Face directory from any checkpoint.

A 1-rank checkpoint holds the policy as a Hugging Face directory (`policy/`); a sharded one
(`learner.num_ranks >= 2`) holds torch.distributed.checkpoint shards (`dcp/`), which need the
base model's architecture to be read. Either way the export is the same: the base model's config
and tokenizer, the trained weights as safetensors, a generation config with the tokenizer's stop
ids, and `slime_export.json` naming the checkpoint it came from. `transformers`, vLLM and SGLang
load it without this project. The job writes it into every checkpoint with `checkpoint.export_hf`.
A LoRA checkpoint (`adapter/`, learner.lora) exports its adapters as a PEFT directory, or with
`--merged` (and in `checkpoint.export_hf`, `slime eval`) the base with the adapters merged.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from slime.config import JobConfig, ModelConfig, config_for_display, dump_config
from slime.errors import UserError
from slime.learner import lora
from slime.learner.sharding import CHECKPOINT_DIR, CheckpointError, load_policy_shards
from slime.model import ensure_model_dir, eos_token_ids, load_model, load_tokenizer

EXPORT_INFO = "slime_export.json"
LATEST = "latest"  # checkpoints/latest: the name of the last checkpoint written (slime/job.py)


class ExportError(UserError, ValueError):
    """A run directory or checkpoint that cannot be exported; names the path and what is missing."""

    hint = "slime export RUN_DIR [--step N] --out DIR: RUN_DIR is a job's output_dir (with checkpoints/step_*)"


def checkpoints_of(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first (driver_state.json is written last)."""
    return sorted(p.parent for p in (run_dir / "checkpoints").glob("step_*/driver_state.json"))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `resume=auto` and `slime export RUN_DIR` take: the one checkpoints/latest names,
    i.e. the last one written by the run that used this output_dir last. A fresh run empties that
    file, so an earlier run's checkpoints (step_* beyond this run's) are not taken for its own.
    Without the file (a run from before it existed) the newest complete one."""
    found = checkpoints_of(run_dir)
    try:
        name = (run_dir / "checkpoints" / LATEST).read_text().strip()
    except FileNotFoundError:
        return found[-1] if found else None
    # `latest` is written after the checkpoint is complete; if it was removed since, an older one.
    not_newer = [p for p in found if p.name <= name] if name else []
    return not_newer[-1] if not_newer else None


def resume_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint a job resumes from: none (resume unset), the run's latest (auto; none yet
    is a start at step 0 whose buffer drops its groups), or the checkpoint directory ``resume`` names."""
    if resume is None:
        return None
    if resume == "auto":
        latest = latest_checkpoint(run_dir)  # the last run's: not an earlier run's step_* beyond it
        if latest is None:
            print(
                f"resume=auto: no checkpoint in {run_dir / 'checkpoints'}: training starts at step 0 "
                "(the buffer's unfinished trajectories are kept and resumed)",
                flush=True,
            )
        return latest
    path = Path(resume).expanduser()
    if not (path / "driver_state.json").is_file():
        raise CheckpointError(f"resume={resume}: not a checkpoint directory (no driver_state.json in it)")
    return path


EARLIER_RUNS = "earlier_runs"
# What a run writes of its own into output_dir; the Redis data, the dataset it generated and the
# directory's secret stay (a fresh run empties the job's buffer).
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "training.png",
    "tensorboard",
    "checkpoints",
    "wandb_run_id",
    "wandb",  # W&B's own folder (logging.wandb.dir unset): the earlier run's offline files
    "mlflow_run_id",
)


def set_earlier_run_aside(run_dir: Path) -> Path | None:
    """A fresh run (no resume) in an output_dir an earlier run trained in: that run's metrics, plot,
    TensorBoard events, config and checkpoints move to output_dir/earlier_runs/N/ (renamed, not
    copied), so nothing of it is overwritten or mixed into the new run's, and `resume=auto` and
    `slime export` find only the new run's checkpoints. Returns that folder; None when no run
    trained here before."""
    if not any((run_dir / name).exists() for name in ("metrics.jsonl", "checkpoints", "tensorboard")):
        return None
    earlier = run_dir / EARLIER_RUNS
    taken = [int(p.name) for p in earlier.glob("*") if p.name.isdigit()] if earlier.is_dir() else []
    aside = earlier / str(max(taken, default=0) + 1)
    aside.mkdir(parents=True)
    for name in RUN_FILES:
        if (run_dir / name).exists() or (run_dir / name).is_symlink():
            (run_dir / name).rename(aside / name)
    return aside


def checkpoint_due(cfg: JobConfig, step: int, last_checkpoint_at: float) -> bool:
    """Every checkpoint.every_steps or checkpoint.every_seconds, whichever comes first; and at the end."""
    every, seconds = cfg.checkpoint.every_steps, cfg.checkpoint.every_seconds
    by_steps = bool(every) and (step + 1) % every == 0
    by_time = bool(seconds) and time.time() - last_checkpoint_at >= seconds
    return by_steps or by_time or step + 1 == cfg.steps


def restore_point(checkpoint: Path | None) -> tuple[int, dict[str, Any] | None]:
    """(next step, its sampler's state) of a checkpoint; (0, None) for none (a resume before the
    first checkpoint: the sampler starts anew)."""
    if checkpoint is None:
        return 0, None
    state = json.loads((checkpoint / "driver_state.json").read_text())
    return int(state["next_step"]), state["sampler"]


def clear_checkpoint_dir(path: Path) -> None:
    """A checkpoint about to be written where one of the same step exists (a run resumed from an
    older checkpoint writes the later steps again): the old one goes first, driver_state.json
    first of all, so no file of the abandoned branch (its policy/, dcp/, hf/, learner state) is
    read as part of the new one."""
    (path / "driver_state.json").unlink(missing_ok=True)
    if path.exists() or path.is_symlink():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def prune_checkpoints(current: Path, keep_last: int | None) -> list[Path]:
    """After `current` was written: delete its run's complete checkpoints of earlier steps (the same
    lineage in driver_state.json: the run and its resumes, not an earlier run's) but the
    newest keep_last - 1 of them (None: none); later steps (a run resumed from an older checkpoint)
    are left alone. Returns those deleted. driver_state.json goes first, so a checkpoint half deleted
    (the process stopped meanwhile) no longer counts as complete for resume=auto or export."""
    if keep_last is None:
        return []
    lineage = _lineage(current)  # this run's and its resumes', never an earlier run's in the same output_dir
    earlier = [p for p in checkpoints_of(current.parent.parent) if p.name < current.name and _lineage(p) == lineage]
    old = earlier[: max(0, len(earlier) - (keep_last - 1))]
    for path in old:
        (path / "driver_state.json").unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return old


def _lineage(checkpoint: Path) -> str | None:
    try:
        return json.loads((checkpoint / "driver_state.json").read_text()).get("lineage")
    except (OSError, ValueError, AttributeError):
        return None


def find_checkpoint(path: Path, step: int | None = None) -> Path:
    """`path` itself when it is a checkpoint; else the run dir's checkpoint after `step` steps
    (default: the latest, see latest_checkpoint)."""
    if (path / "driver_state.json").is_file():
        if step is not None:
            raise ExportError(f"{path} is one checkpoint; --step picks one of a run dir's checkpoints")
        return path
    if not path.is_dir():
        raise ExportError(f"{path}: no such directory")
    found = checkpoints_of(path)
    if not found:
        raise ExportError(f"{path}: no complete checkpoint in {path / 'checkpoints'} (is it a run's output_dir?)")
    if step is None:
        latest = latest_checkpoint(path)
        if latest is None:
            raise ExportError(
                f"{path}: the last run in it (a fresh one) has written no checkpoint yet; "
                f"{', '.join(p.name for p in found)} are an earlier run's: --step N takes one of them"
            )
        return latest
    by_step = {int(p.name.removeprefix("step_")): p for p in found}
    if step not in by_step:
        raise ExportError(f"{path}: no checkpoint after step {step}; there are {sorted(by_step)}")
    return by_step[step]


def run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent


def config_of(checkpoint: Path) -> Path:
    """The config that trained ``checkpoint``: its own copy (written with it), else its run's
    config.yaml (checkpoints of older versions). The run's file is the last start's, which a resume
    with other settings has rewritten since."""
    own = checkpoint / "config.yaml"
    if own.is_file() or not (checkpoint / "driver_state.json").is_file():
        return own  # missing when the checkpoint is gone (set aside, pruned): not another run's file
    return run_dir_of(checkpoint) / "config.yaml"


def model_config_of(config_path: Path) -> ModelConfig:
    """The `model` section of a job's config.yaml. Only this section: the rest may name secrets
    (`${NAME}` references) that are not set where the export runs."""
    if not config_path.is_file():
        raise ExportError(
            f"{config_path.parent}: no config.yaml (the job writes it at start; is this a run's output_dir?)"
        )
    data = yaml.safe_load(config_path.read_text()) or {}
    return ModelConfig.model_validate(data.get("model") or {})


def write_resumed_config(cfg: JobConfig, run_dir: Path, checkpoint: Path) -> None:
    """A resume's config.yaml, written once its checkpoint has loaded (a resume refused leaves the
    run's file as it was), after saying which settings differ from those that trained the checkpoint."""
    changes = config_changes(config_of(checkpoint), cfg)
    if changes:
        print(f"resume: {len(changes)} settings differ from {checkpoint.name}'s: " + "; ".join(changes), flush=True)
    dump_config(cfg, run_dir / "config.yaml")


def base_model_dir(checkpoint: Path) -> Path:
    """The base model directory the checkpoint was trained from (model.path, or the tiny MoE from
    the cache, rebuilt if gone)."""
    return ensure_model_dir(model_config_of(config_of(checkpoint)))


def check_same_architecture(checkpoint: Path, model_dir: Path) -> None:
    """A policy saved whole (`policy/config.json`) loads without its base, so a base of another
    model would pass silently: its tokenizer and config would be exported with these weights."""
    saved = checkpoint / "policy" / "config.json"
    base = Path(model_dir) / "config.json"
    if not saved.is_file() or not base.is_file():
        return
    ours, theirs = json.loads(saved.read_text()), json.loads(base.read_text())
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
        if ours.get(key) != theirs.get(key):
            raise ExportError(
                f"{checkpoint}: its policy has {key}={ours.get(key)!r} but the base model {model_dir} has "
                f"{theirs.get(key)!r}; that base's tokenizer and config do not belong to these weights (give the "
                "base the run was trained from)"
            )


def is_lora(checkpoint: Path) -> bool:
    return (checkpoint / lora.ADAPTER_DIR).is_dir()


def load_checkpoint_policy(checkpoint: Path, model_dir: Path, dtype: str = "float32") -> torch.nn.Module:
    """The trained policy of a checkpoint, sharded or not, as one plain (CPU) model; a LoRA
    checkpoint's adapters merged into its base (which must be the base they were trained on)."""
    if is_lora(checkpoint):
        return lora.merged_policy(checkpoint, model_dir, dtype)
    if (checkpoint / "policy" / "config.json").is_file():
        return load_model(checkpoint / "policy", dtype)
    if (checkpoint / CHECKPOINT_DIR).is_dir():
        model = load_model(model_dir, dtype)
        load_policy_shards(checkpoint, model)
        return model
    raise ExportError(f"{checkpoint}: neither a policy/ directory nor {CHECKPOINT_DIR}/ shards in it")


def export_checkpoint(
    checkpoint: Path, out: Path, model_dir: Path | None = None, merged: bool = True, dtype: str | None = None
) -> Path:
    """Write `checkpoint`'s policy to `out` as a Hugging Face directory (replaced if it exists, at
    once: a reader sees the old export or the new one), in ``dtype`` (default: the run's
    model.dtype). A LoRA checkpoint with merged=False: its adapters as a PEFT directory
    (`PeftModel.from_pretrained(base, out)`) and the tokenizer. The tokenizer is the base's as it
    was (the job's pad-with-EOS fallback is not written into it)."""
    check_export_target(out, checkpoint)  # before the base model is found (or built, for the tiny MoE)
    model_dir = model_dir or base_model_dir(checkpoint)
    check_export_target(out, checkpoint, Path(model_dir))
    check_same_architecture(checkpoint, Path(model_dir))
    if dtype is None:
        dtype = model_config_of(config_of(checkpoint)).dtype if config_of(checkpoint).is_file() else "float32"
    adapter_only = is_lora(checkpoint) and not merged
    model = None if adapter_only else load_checkpoint_policy(checkpoint, Path(model_dir), dtype)
    tokenizer = load_tokenizer(model_dir, pad_with_eos=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        if model is None:
            for path in (checkpoint / lora.ADAPTER_DIR).iterdir():
                shutil.copy2(path, tmp / path.name)
            # A causal LM's adapters: AutoPeftModelForCausalLM needs the task type to pick its class.
            adapter_config = json.loads((tmp / "adapter_config.json").read_text())
            adapter_config["task_type"] = adapter_config.get("task_type") or "CAUSAL_LM"
            (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
            shutil.copy2(checkpoint / lora.BASE_INFO, tmp / lora.BASE_INFO)
        else:
            eos = eos_token_ids(tokenizer)  # the base directory's list too (Llama 3: <|eot_id|>), not one id
            model.generation_config.eos_token_id = eos if len(eos) > 1 else (eos[0] if eos else None)
            if model.generation_config.pad_token_id is None:  # the base's own pad id stays
                model.generation_config.pad_token_id = tokenizer.pad_token_id
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        state = json.loads((checkpoint / "driver_state.json").read_text())
        info = {
            "checkpoint": str(checkpoint.resolve()),
            "steps": state.get("next_step"),
            "base_model": str(model_dir),
            "content": "lora_adapter" if model is None else ("merged_lora" if is_lora(checkpoint) else "full"),
        }
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        _readable_as_umask_allows(tmp)  # mkdtemp makes 0700 and safetensors 0600: a server of another user reads it
        if out.exists() and _exchange(tmp, out):
            shutil.rmtree(tmp, ignore_errors=True)  # the earlier export, swapped out
            return out
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _exchange(new: Path, old: Path) -> bool:
    """Swap two directories in one step (Linux renameat2 RENAME_EXCHANGE), so a reader of `old` sees
    the earlier export or the new one, never neither; False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(new), at_fdcwd, os.fsencode(old), rename_exchange) == 0


def _readable_as_umask_allows(folder: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def check_export_target(out: Path, checkpoint: Path, model_dir: Path | None = None) -> None:
    """`out` is replaced as a whole, so it must be new, empty, or an earlier export (it holds
    EXPORT_INFO); never the checkpoint, its run directory, the base model the run trained from
    (itself an earlier export, maybe) or a folder above them."""
    if out.is_symlink():
        raise ExportError(f"--out {out} is a symbolic link", hint="name the directory itself, or a new one")
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory", hint="name a new or empty directory")
    target = out.resolve()
    sources = [(checkpoint, "the checkpoint")] + (
        [(model_dir, "the base model the run trained from")] if model_dir else []
    )
    for source, what in sources:
        if target == source.resolve() or target in source.resolve().parents:
            raise ExportError(
                f"--out {out} holds {what}, {source} (exporting there would delete it)",
                hint="name a new directory outside the run, e.g. --out exported/",
            )
    if any(out.iterdir()) and not (out / EXPORT_INFO).is_file():
        raise ExportError(
            f"--out {out} is a non-empty directory that is not an earlier export (no {EXPORT_INFO}); "
            f"export replaces the whole directory",
            hint="name a new or empty directory, or an earlier export to replace",
        )


def main_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="slime export", description="Write a checkpoint's policy as a Hugging Face directory."
    )
    parser.add_argument("path", type=Path, help="a run's output_dir, or one checkpoint directory in it")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint after N steps (default: the newest)")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="the weights' precision (default: the run's model.dtype; a bf16 base trained in float32 exports float32)",
    )
    parser.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA checkpoint: the base with the adapters merged (default: the adapters as a PEFT directory)",
    )
    ns = parser.parse_args(argv)
    checkpoint = find_checkpoint(ns.path.expanduser(), ns.step)
    try:
        merged = ns.merged or not is_lora(checkpoint)
        out = export_checkpoint(checkpoint, ns.out.expanduser(), merged=merged, dtype=ns.dtype)
    except FileNotFoundError as exc:
        if (checkpoint / "driver_state.json").is_file():
            raise
        raise ExportError(
            f"{checkpoint} was deleted while it was read ({exc.filename} is gone): its job, still running, keeps "
            "only its newest checkpoints (checkpoint.keep_last)",
            hint="run the export again (it takes the newest checkpoint), or name a checkpoint with --step",
        ) from None
    if is_lora(checkpoint) and not ns.merged:
        print(f"exported {checkpoint}'s adapters -> {out} (PeftModel.from_pretrained(base, {out}) loads them)")
    else:
        print(f"exported {checkpoint} -> {out} (AutoModelForCausalLM.from_pretrained loads it)")
    return 0


def config_changes(earlier: Path, cfg: JobConfig) -> list[str]:
    """``key: before -> now`` for every setting of ``cfg`` that differs from the config.yaml at
    ``earlier`` (a resume's view of what it changes); [] when there is no such file."""
    if not earlier.is_file():
        return []
    before, now = _flat(yaml.safe_load(earlier.read_text()) or {}), _flat(config_for_display(cfg))
    skip = {"resume", "steps"}  # a resume sets these by nature
    return [
        f"{key}: {before.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(before.keys() | now.keys())
        if key not in skip and before.get(key) != now.get(key)
    ]


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}{key}." if isinstance(value, dict) and value else f"{prefix}{key}"))
    return out
