"""`slime simulate [CONFIG.yaml | PRESET] [key=value ...]`: a job config or a preset -> the APRIL
simulator (april/sim/run.py), which takes only its own plain settings (`SimConfig`). The presets
are april/sim/config.py's PRESETS (ARGS_HELP and `--help` name them all)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from april.sim import PRESETS, SimConfig, compare, format_table, headline, plot
from slime.config import ConfigError, JobConfig, format_validation_error, load_config, parse_override

# The positional arguments' help, every preset of april/sim/config.py named (slime/cli.py's
# `slime simulate --help` should show this one).
ARGS_HELP = f"[CONFIG.yaml | {' | '.join(PRESETS)}] then key=value overrides (sim.<field>=v, preset=NAME, out=PATH)"


def sim_config_from_job(job: JobConfig, overrides: dict[str, Any] | None = None) -> SimConfig:
    """A job's rollout shape on the preset matching its device (cpu -> cpu_tiny, else paper)."""
    base = PRESETS["cpu_tiny" if job.rollout.device == "cpu" else "paper"].model_dump()
    r = job.rollout
    base.update(
        engines=r.num_workers,
        slots=r.max_running_requests,
        batch_size=r.batch_size,
        n_samples=r.n_samples_per_prompt,
        max_tokens=r.max_new_tokens,
        oversample=job.april.oversample,
        max_staleness=max(1, job.max_staleness),
        seed=job.seed,
    )
    e = r.elastic
    if e.enabled:  # the same bounds and watermarks (april/elastic.py decides in both)
        base.update(
            elastic=True,
            elastic_min_engines=e.min_workers,
            elastic_max_engines=e.max_workers,
            elastic_low_watermark=e.low_watermark,
            elastic_high_watermark=e.high_watermark,
            elastic_cooldown_steps=e.cooldown_steps,
        )
    base["resume_from_kept_kv"] = r.engine == "builtin" and r.kept_kv_tokens > 0
    if job.rollout.device == "cpu":  # the CPU engine has no KV pool to exhaust: room for every slot
        per_request = base["prompt_tokens"] + r.max_new_tokens
        base["kv_tokens"] = max(base["kv_tokens"], r.max_running_requests * per_request)
    base.update(overrides or {})
    return _validate(base)


def _validate(data: dict[str, Any]) -> SimConfig:
    try:
        return SimConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(
            format_validation_error(err, "invalid simulator config (SimConfig in april/sim/config.py)", "sim.")
        ) from None


def _preset(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name].model_dump()


def config_from_cli(args: list[str]) -> tuple[SimConfig, Path]:
    """`[CONFIG.yaml | PRESET] [key=value ...]` -> (SimConfig, plot path).

    CONFIG is a job YAML (its rollout shape is simulated) or a YAML with a top-level `sim:`
    section (optionally `preset: NAME` inside it); a bare word is a preset name; nothing means
    `paper`. Overrides: `sim.<field>=v` (or `<field>=v` outside a job YAML) set simulator fields,
    other dotted keys override the job YAML, `preset=NAME` picks the base, `out=PATH` the plot.
    """

    source = args[0] if args and "=" not in args[0] else None
    rest = args[1:] if source is not None else args
    sim_overrides: dict[str, Any] = {}
    job_overrides: list[str] = []
    out, preset = Path("simulate.png"), None
    is_job = source is not None and Path(source).is_file()
    loaded: dict[str, Any] = {}
    if is_job:
        try:
            loaded = yaml.safe_load(Path(source).read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML ({exc})") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: the top level must be a mapping")
        is_job = "sim" not in loaded
    for text in rest:
        path, value = parse_override(text)
        if path == ["out"]:
            out = Path(str(value))
        elif path == ["preset"]:
            preset = str(value)
        elif path[0] == "sim" and len(path) == 2:
            sim_overrides[path[1]] = value
        elif is_job:
            job_overrides.append(text)
        elif len(path) == 1:
            sim_overrides[path[0]] = value
        else:
            raise ConfigError(f"override {text!r}: simulator fields are flat (e.g. t0=0.01 or sim.t0=0.01)")

    if is_job:
        return sim_config_from_job(load_config(source, job_overrides), sim_overrides), out
    if source is not None and not Path(source).is_file():
        if preset is not None:
            raise ConfigError("give either a preset name or preset=NAME, not both")
        if source not in PRESETS:
            raise ConfigError(f"{source}: not a file and not a preset ({', '.join(PRESETS)})")
        preset = source
    section = dict(loaded.get("sim") or {})
    if not isinstance(loaded.get("sim") or {}, dict):
        raise ConfigError(f"{source}: `sim:` must be a mapping of simulator fields")
    data = _preset(preset or section.pop("preset", None) or "paper")
    section.pop("preset", None)
    data.update(section)
    data.update(sim_overrides)
    return _validate(data), out


def main_simulate(args: list[str]) -> int:
    """`slime simulate [CONFIG.yaml | PRESET] [key=value ...]`: table, simulate.png, JSON last line."""
    if args and args[0] in ("-h", "--help"):
        print(f"usage: slime simulate {ARGS_HELP}\npresets: {', '.join(PRESETS)} (april/sim/config.py)")
        return 0
    try:
        cfg, out = config_from_cli(args)
    except ConfigError as exc:
        print(f"slime simulate: {exc}", file=sys.stderr)
        return 2
    results = compare(cfg)
    print(
        f"{cfg.engines} engines x {cfg.slots} slots, B={cfg.batch_size} groups x {cfg.n_samples}, "
        f"max {cfg.max_tokens} tokens, {cfg.steps} steps; t0={cfg.t0 * 1e3:g} ms, k={cfg.k * 1e3:g} ms/request, "
        f"t_kv={cfg.t_kv * 1e9:g} ns/KV token, p={cfg.p * 1e6:g} us/prefill token"
    )
    print(format_table(results))
    print(f"plot: {plot(results, out)}")
    print(json.dumps(headline(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main_simulate(sys.argv[1:]))
