"""What every config section shares: the strict base model and the error a bad config raises."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from slime.errors import UserError


class StrictModel(BaseModel):
    """Unknown keys fail at load with their dotted path; assignments are validated too. No number may
    be inf or nan: no field means "unbounded" by inf, and learner.lr=inf trained NaN weights."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ConfigError(UserError, ValueError):
    """A configuration that cannot run; the message names the field and the reason."""

    hint = "`slime config [CONFIG.yaml] [key=value ...]` prints every field with the value it would take"


# The device types torch.device parses (its own error lists them), optionally with an index.
DEVICE_PATTERN = re.compile(
    r"^(cpu|cuda|ipu|xpu|mkldnn|opengl|opencl|ideep|hip|ve|fpga|maia|xla|lazy|vulkan|mps|meta|hpu|mtia|privateuseone)"
    r"(:[0-9]+)?$"
)


def check_device(value: str) -> str:
    """A device field's value (rollout.device, learner.device): what torch.device takes."""
    if not DEVICE_PATTERN.match(value):
        raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:N, ...)")
    return value
