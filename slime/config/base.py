"""What every config section shares: the strict base model and the error a bad config raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from slime.errors import UserError


class StrictModel(BaseModel):
    """Unknown keys fail at load with their dotted path; assignments are validated too. No number may
    be inf or nan: no field means "unbounded" by inf, and learner.lr=inf trained NaN weights."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ConfigError(UserError, ValueError):
    """A configuration that cannot run; the message names the field and the reason."""

    hint = "`slime config [CONFIG.yaml] [key=value ...]` prints every field with the value it would take"
