"""The sandbox's settings (envs/sandbox.py): `SandboxConfig`, checked where it is built.

Users give these as `env.kwargs.sandbox` (ToolEnv's python tool, SweEnv) or build a
`SandboxConfig` for the code reward. A setting that cannot work must fail there, naming it, not
later as every run's result: an unknown key used to be ignored (`timeout: 1` left the timeout at
10 s), `timeout_s: .inf` raised OverflowError in every run, `cpu_s: 0` made every run a timeout, and
`cpu_s: -1` or a `memory_mb` past what prlimit takes made every run an `error` whose stderr (prlimit's)
read like the user's code had failed. So: unknown keys are refused with the accepted ones (and a
did-you-mean), numbers must be finite and within these bounds, and strings that become argv,
paths or environment entries hold no NUL:

| setting | bounds |
| --- | --- |
| `timeout_s` | > 0 and <= 3600 (an hour) |
| `cpu_s` | 1 to 86400 (a day: CPU seconds may pass the wall clock with threads) |
| `memory_mb`, `total_memory_mb` | 64 MiB to 1 TiB (1048576) |
| `max_file_mb`, `write_quota_mb` | 1 MiB to 1 TiB (the quota is a tmpfs: memory) |
| `max_processes` | 1 to 4194304 (the kernel's largest pid_max) |
| `max_open_files` | 16 to 1048576 (Linux's default `fs.nr_open`: more is refused) |
| `max_output_bytes` | 256 B to 1 GiB per stream (held in memory) |
| `max_files` | 16 to 10 million |
| `host_uid_base`, `host_uid_count` | base 1000 to 2^31, count 1 to 2^20 |
| `extra_ro_binds` | absolute paths |

`sandbox_config(value)` turns a dict (or None, or a SandboxConfig, which is checked again) into a
SandboxConfig, or raises `SandboxConfigError` (a UserError and a ValueError) naming what is wrong.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from slime.errors import UserError

MAX_TIMEOUT_S = 3600
MAX_CPU_S = 86_400
MAX_MB = 1 << 20  # 1 TiB in MiB: more memory (or disk) than a machine that runs this has


class SandboxConfigError(UserError, ValueError):
    """Sandbox settings that cannot work (an unknown key, a number out of its bounds)."""

    hint = "fix the sandbox settings (env.kwargs.sandbox); their bounds are in envs/sandbox_config.py"


class SandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", revalidate_instances="always")

    mode: Literal["bwrap", "unsafe_no_namespaces"] = "bwrap"
    python: str = Field("/usr/bin/python3", min_length=1)
    bwrap: str = Field("bwrap", min_length=1)
    timeout_s: float = Field(10.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="wall clock per run")
    cpu_s: int | None = Field(None, ge=1, le=MAX_CPU_S, description="RLIMIT_CPU; default ceil(timeout_s) + 1")
    memory_mb: int = Field(512, ge=64, le=MAX_MB, description="RLIMIT_AS of every process in the sandbox")
    total_memory_mb: int = Field(
        1024, ge=64, le=MAX_MB, description="all the run's processes together (a memory cgroup, where one can be made)"
    )
    max_processes: int = Field(32, ge=1, le=1 << 22, description="RLIMIT_NPROC (threads count too)")
    max_file_mb: int = Field(16, ge=1, le=MAX_MB, description="RLIMIT_FSIZE")
    max_open_files: int = Field(64, ge=16, le=1 << 20, description="RLIMIT_NOFILE")
    max_output_bytes: int = Field(64 * 1024, ge=256, le=1 << 30, description="per stream; past it the run is killed")
    write_quota_mb: int = Field(
        64, ge=1, le=MAX_MB, description="one limit for /work, /tmp and /dev/shm together (a tmpfs: memory, not disk)"
    )
    max_files: int = Field(
        4096, ge=16, le=10_000_000, description="files and directories the run may create, in all those places"
    )
    host_uid_base: int = Field(61000, ge=1000, le=1 << 31, description="dedicated host uids when run as root")
    host_uid_count: int = Field(1000, ge=1, le=1 << 20)
    extra_ro_binds: list[str] = Field(default_factory=list, description="host paths bound read-only at the same place")
    env: dict[str, str] = Field(default_factory=dict, description="added to the minimal environment")

    @model_validator(mode="before")
    @classmethod
    def _known_settings(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = list(cls.model_fields)
            for key in data:
                if key not in known:
                    near = difflib.get_close_matches(str(key), known, n=1)
                    meant = f" (did you mean {near[0]!r}?)" if near else ""
                    raise ValueError(f"unknown sandbox setting {key!r}{meant}; the settings are: {', '.join(known)}")
        return data

    @field_validator("python", "bwrap", "extra_ro_binds", "env")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        texts = [value] if isinstance(value, str) else [*value, *value.values()] if isinstance(value, dict) else value
        if any("\x00" in text for text in texts):
            raise ValueError("must not contain NUL characters")
        if isinstance(value, dict) and any(not key or "=" in key for key in value):
            raise ValueError("environment names must be non-empty and hold no '='")
        if isinstance(value, list) and not all(path.startswith("/") for path in value):
            raise ValueError("must be absolute paths")
        return value


def sandbox_config(value: SandboxConfig | dict | None) -> SandboxConfig:
    """The checked settings; SandboxConfigError naming every setting that is wrong."""
    if value is None:
        return SandboxConfig()
    if not isinstance(value, (dict, SandboxConfig)):
        raise SandboxConfigError(f"sandbox settings must be a mapping of settings, got {type(value).__name__}")
    try:
        return SandboxConfig.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(_problem(e["loc"], e["msg"]) for e in exc.errors())
        raise SandboxConfigError(f"sandbox settings: {problems}") from None


def _problem(loc: tuple, msg: str) -> str:
    msg = msg.removeprefix("Value error, ")  # a validator's own message
    return f"{'.'.join(str(p) for p in loc)}: {msg}" if loc else msg
