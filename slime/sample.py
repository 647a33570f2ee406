"""The trajectory record that flows through the whole system (docs/architecture.md, "Sample / Trajectory").

Token-in/token-out: the prompt and response are token ids; every response token carries the
behaviour logprob, the policy version that produced it and a loss mask (0 for env/tool tokens).
The per-token arrays always have the same length; `append` refuses chunks that would break that.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np


class Status(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    ABORTED = "aborted"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    FAILED = "failed"


FINAL_STATUSES = frozenset({Status.COMPLETED, Status.TRUNCATED, Status.FAILED})

TOKEN_DTYPE = np.int32
LOGPROB_DTYPE = np.float32
VERSION_DTYPE = np.int32
MASK_DTYPE = np.int8


class ChunkLengthError(ValueError):
    """A chunk whose per-token arrays do not have one entry per token."""


def new_id() -> str:
    return uuid.uuid4().hex[:16]


def _empty(dtype: type) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass
class Sample:
    group_id: str
    index: int
    prompt_ids: np.ndarray
    max_new_tokens: int
    id: str = field(default_factory=new_id)
    response_ids: np.ndarray = field(default_factory=lambda: _empty(TOKEN_DTYPE))
    logprobs: np.ndarray = field(default_factory=lambda: _empty(LOGPROB_DTYPE))
    versions: np.ndarray = field(default_factory=lambda: _empty(VERSION_DTYPE))
    loss_mask: np.ndarray = field(default_factory=lambda: _empty(MASK_DTYPE))
    status: Status = Status.PENDING
    reward: float | None = None
    # Per-token rewards (e.g. a process reward model's step scores placed on step-end tokens);
    # same length as response_ids when set.
    token_rewards: np.ndarray | None = None
    failure: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    # Routing replay: per response token, the experts each MoE layer chose at the position that
    # sampled it [T, layers * top_k] (255: none recorded); None when the engine recorded none.
    routing: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=TOKEN_DTYPE)
        self.response_ids = np.asarray(self.response_ids, dtype=TOKEN_DTYPE)
        self.logprobs = np.asarray(self.logprobs, dtype=LOGPROB_DTYPE)
        self.versions = np.asarray(self.versions, dtype=VERSION_DTYPE)
        self.loss_mask = np.asarray(self.loss_mask, dtype=MASK_DTYPE)
        self.status = Status(self.status)
        n = len(self.response_ids)
        if not (len(self.logprobs) == len(self.versions) == len(self.loss_mask) == n):
            raise ChunkLengthError(
                f"sample {self.id}: per-token arrays differ in length: response_ids={n}, "
                f"logprobs={len(self.logprobs)}, versions={len(self.versions)}, loss_mask={len(self.loss_mask)}"
            )
        if self.routing is not None and len(self.routing) != n:
            raise ChunkLengthError(f"sample {self.id}: routing has {len(self.routing)} rows for {n} response tokens")

    def append(
        self,
        token_ids: np.ndarray | list[int],
        logprobs: np.ndarray | list[float],
        version: int | np.ndarray | list[int],
        loss_mask: int | np.ndarray | list[int] = 1,
    ) -> None:
        """Append one chunk. A scalar `version`/`loss_mask` applies to every token of the chunk."""
        tokens, lps, vers, mask = normalize_chunk(token_ids, logprobs, version, loss_mask)
        self.response_ids = np.concatenate([self.response_ids, tokens])
        self.logprobs = np.concatenate([self.logprobs, lps])
        self.versions = np.concatenate([self.versions, vers])
        self.loss_mask = np.concatenate([self.loss_mask, mask])
        if self.routing is not None:  # tokens appended here carry no recorded experts
            self.routing = np.concatenate([self.routing, np.full((len(tokens), self.routing.shape[1]), 255, np.uint8)])
        self.updated_at = time.time()

    @property
    def response_length(self) -> int:
        return int(len(self.response_ids))

    @property
    def remaining_tokens(self) -> int:
        """What a resumed generation may still produce: max_new_tokens less what it already has."""
        return max(0, self.max_new_tokens - self.response_length)

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES

    @property
    def version_span(self) -> int:
        """How many policy versions the response tokens cover (0 when one version made them all)."""
        if len(self.versions) == 0:
            return 0
        return int(self.versions.max() - self.versions.min())

    @property
    def min_version(self) -> int | None:
        return int(self.versions.min()) if len(self.versions) else None


def as_json(value: Any) -> Any:
    """``value`` as the buffer stores it (JSON): numpy and torch scalars become numbers, anything
    else JSON cannot encode becomes its text (a reward's or an env's info)."""
    return json.loads(json.dumps(value, default=_scalar_or_text))


def _scalar_or_text(value: Any) -> Any:
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return item()
    return str(value)


# "reward function NAME raised ValueError: ..." -> "reward function NAME raised ValueError"
# A reward given as a spec dict (rewards/mix.py) is named by its repr, "{'fn': ..., 'kwargs': {...}}", which
# holds spaces: it is matched up to the first kind of failure after a closing brace or bracket.
_FAILURE_HEAD = re.compile(
    r"^(reward function|group reward|env) (\{.*?\}|\[.*?\]|\S+) "
    r"(raised \w+|timed out|took longer|returned|gave None|did not finish|not called)"
)
_SPEC_FUNCTION = re.compile(r"'([\w./-]+:\w+)'")


def failure_key(failure: str | None) -> str:
    """A failure reason without its per-sample details, to count failures by what broke and how:
    the reward function or env named and the kind of failure ("raised ValueError", "timed out",
    "returned"; a file plugin by its file name), else the reason's first line up to its first colon (at most 80 characters)."""
    lines = (failure or "").strip().splitlines()
    text = lines[0] if lines else "no reason given"
    head = _FAILURE_HEAD.match(text)
    if head is None:
        return text.split(": ", 1)[0][:80]
    what, name, how = head.groups()
    if name[0] in "{[":  # a spec: by the functions it names (kwargs, such as a judge's template, left out)
        functions = list(dict.fromkeys(_SPEC_FUNCTION.findall(name)))
        name = "+".join(f.rsplit("/", 1)[-1] for f in functions[:3]) or "spec"
    return f"{what} {name.rsplit('/', 1)[-1]} {how}"  # a file plugin by its file name, not its path


def normalize_chunk(
    token_ids: np.ndarray | list[int],
    logprobs: np.ndarray | list[float],
    version: int | np.ndarray | list[int],
    loss_mask: int | np.ndarray | list[int] = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Turn one chunk into four equal-length arrays of the stored dtypes, or raise ChunkLengthError."""
    tokens = np.asarray(token_ids, dtype=TOKEN_DTYPE).reshape(-1)
    lps = np.asarray(logprobs, dtype=LOGPROB_DTYPE).reshape(-1)
    n = len(tokens)
    vers = (
        np.full(n, version, dtype=VERSION_DTYPE)
        if np.isscalar(version)
        else np.asarray(version, dtype=VERSION_DTYPE).reshape(-1)
    )
    mask = (
        np.full(n, loss_mask, dtype=MASK_DTYPE)
        if np.isscalar(loss_mask)
        else np.asarray(loss_mask, dtype=MASK_DTYPE).reshape(-1)
    )
    if not (len(lps) == len(vers) == len(mask) == n):
        raise ChunkLengthError(
            f"chunk arrays differ in length: tokens={n}, logprobs={len(lps)}, "
            f"versions={len(vers)}, loss_mask={len(mask)}"
        )
    return tokens, lps, vers, mask
