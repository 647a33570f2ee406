"""`DynamicFilterOutput`: a group filter's answer, as slime's filters return it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DynamicFilterOutput:
    keep: Any  # a bool, or a numpy or 0-d torch bool
    reason: str | None = None  # why slime dropped the group; here every drop counts as group_filter
